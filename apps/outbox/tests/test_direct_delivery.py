"""Direct delivery (docs/architecture.md §6; :mod:`apps.outbox.direct`): the run that commits a new
ticket's intent delivers the outbox row itself. What a dispatcher guarantees still holds at each
boundary the change moved: the intent, the claimed row and the attempt row are committed before the
request leaves; the receipt, ``receipt.recorded`` and ``task.completed`` commit together; a run
that dies before or after the request leaves a row a dispatcher takes over once its lease expires,
with the same key and the next fencing token (one ticket); a run overtaken by a dispatcher is
fenced out; a lost answer is reconciled by key; a cancel during the request is honoured. The
reference ticket service is a real HTTP server on loopback."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.agent.runner import agent_run, context_read
from apps.approvals.models import ApprovalPolicy, ApprovalRequest
from apps.core import queue
from apps.events.models import TaskEvent
from apps.outbox import direct
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.unknown_outcomes import actions_reconcile
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_submit
from tests.conftest import p, reads_run, settle_receipts

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing after it runs, nothing is cleaned up."""


@pytest.fixture
def direct_on(settings, refservice, tenant):
    """Direct delivery on (the product's default; in-process tests run with it off), and an
    approval policy that lets a ticket be created without a person."""
    settings.FAULTDESK = {**settings.FAULTDESK, "OUTBOX_DIRECT_DELIVERY": True}
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "ticket.create": {"requires_approval": False, "ttl_minutes": 60}})


@pytest.fixture
def sent(monkeypatch):
    """The Celery messages sent during the test (name, args), none of them delivered."""
    messages = []
    monkeypatch.setattr(queue, "send_now", lambda name, *args: messages.append((name, *map(str, args))))
    return messages


def _runs(task_id, rounds: int = 8) -> Task:
    """The agent's and tools' runs only (no dispatcher, no settlement, no reconciler), until the
    task stops moving."""
    last = None
    for _ in range(rounds):
        agent_run(task_id=task_id)
        context_read(task_id=task_id)
        reads_run(task_id)  # the reads, each an activity of its own
        task = Task.objects.get(pk=task_id)
        if task.version == last:
            break
        last = task.version
    return task


def _submit(requester, device) -> Task:
    return task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task


def _at(monkeypatch, point: str, do) -> None:
    """Run ``do()`` when the direct sender reaches failpoint ``point`` (once)."""
    done = []

    def failpoint(name):
        if name == point and not done:
            done.append(name)
            do()

    monkeypatch.setattr(direct, "failpoint", failpoint)


def _kill():
    raise Killed


def _killed_at(monkeypatch, point: str, requester, device):
    """A report whose run dies at the direct sender's failpoint ``point``; ``(task, action)``."""
    _at(monkeypatch, point, _kill)
    task = _submit(requester, device)
    with pytest.raises(Killed):
        _runs(task.pk)
    return task, Action.objects.get(task=task)


def _expire_outbox_leases():
    for row in OutboxMessage.objects.filter(status=OutboxStatus.IN_FLIGHT):
        OutboxMessage.objects.filter(pk=row.pk).update(lease_expires_at=row.created_at)


def _events(task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))


@pytest.mark.django_db(transaction=True)  # the messages a commit sends are sent after it
def test_the_run_that_commits_the_intent_delivers_the_ticket_and_completes_the_task(
        requester, device, kb, direct_on, refadmin, sent):
    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.COMPLETED
    action = Action.objects.get(task=task)
    assert action.status == ActionStatus.SUCCEEDED
    assert refadmin.effects(action.idempotency_key) == 1 and refadmin.requests(action.idempotency_key) == 1
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_generation, row.attempts, row.lease_owner) == (OutboxStatus.DELIVERED, 1, 1, None)
    [attempt] = ActionAttempt.objects.filter(action=action)
    assert (attempt.number, attempt.fencing_token, attempt.outcome) == (1, 1, AttemptOutcome.RECEIPT)
    assert task.state["receipt"]["external_id"] == action.external_id
    assert _events(task)[-3:] == ["intent.committed", "receipt.recorded", "task.completed"]
    # no dispatcher kick and no settle message: the report crossed Celery once (web -> tools)
    names = [m[0] for m in sent]
    assert queue.OUTBOX_DISPATCH not in names and queue.RECEIPTS_SETTLE not in names


def test_the_receipt_the_task_receipt_and_the_answer_commit_together(requester, device, kb, direct_on, refadmin):
    task = _runs(_submit(requester, device).pk)
    events = {e.type: e for e in TaskEvent.objects.filter(task=task)}
    action = Action.objects.get(task=task)
    # one commit: the same transaction id on the action's row version and both events is not
    # visible through the ORM, so the check is on what one commit leaves: the receipt's and the
    # completion's events next to each other and the rows' times equal to the receipt's record
    assert events["task.completed"].seq == events["receipt.recorded"].seq + 1
    assert events["receipt.recorded"].payload["recorded_at"] == action.updated_at.isoformat()
    assert OutboxMessage.objects.get(action=action).delivered_at == action.updated_at


def test_the_receipts_transaction_locks_the_action_then_the_task_and_reads_neither_again(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    """After the request, the run's transaction locks the action's row, then the task's (read whole:
    the run holds it), writes the receipt on the outbox's rows and appends ``receipt.recorded`` and
    ``task.completed`` with no further read of the task or the action and no separate lock."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.outbox import direct

    captured = {}
    real = direct.direct_send

    def send_then_capture(send):
        receipt = real(send)
        captured["ctx"] = CaptureQueriesContext(connection)
        captured["ctx"].__enter__()  # from here to the run's end: the receipt's transaction
        return receipt

    monkeypatch.setattr("apps.agent.runner.direct_send", send_then_capture)
    task = _submit(requester, device)
    agent_run(task_id=task.pk)  # retrieval.started, then handed to the tools pool
    context_read(task_id=task.pk)  # the plan, the local reads; the ticket read handed to its activity
    reads_run(task.pk)  # the ticket read completes the join: the draft, the intent, the request, the receipt
    captured["ctx"].__exit__(None, None, None)
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.COMPLETED
    statements = [q["sql"].lstrip() for q in captured["ctx"].captured_queries]
    on_task = [q for q in statements if "tasks_task" in q.split(" WHERE ")[0] and not q.startswith("UPDATE")]
    on_action = [q for q in statements if q.startswith("SELECT") and '"actions_action"' in q.split(" WHERE ")[0]]
    assert len(on_task) == 1 and on_task[0].endswith("FOR NO KEY UPDATE"), on_task
    assert len(on_action) == 1 and on_action[0].endswith("FOR UPDATE"), on_action
    assert not [q for q in statements if q.startswith("SELECT 1 FROM tasks_task")], "no separate lock of the row"
    assert _events(task)[-2:] == ["receipt.recorded", "task.completed"]


@pytest.mark.django_db(transaction=True)
def test_the_intent_the_claimed_row_and_the_attempt_are_committed_before_the_request_leaves(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    seen = {}

    def look_from_another_connection():
        # what any other session (a dispatcher, a sweeper) can see at this moment
        def read():
            try:
                row = OutboxMessage.objects.get(action__task__requester=requester)
                attempt = ActionAttempt.objects.get(action_id=row.action_id)
                seen.update(status=row.status, token=row.lease_generation, attempts=row.attempts,
                            attempt=(attempt.number, attempt.fencing_token, attempt.outcome),
                            intent=TaskEvent.objects.filter(task_id=attempt.action.task_id,
                                                            type="intent.committed").exists())
            finally:
                connection.close()
        thread = threading.Thread(target=read)
        thread.start()
        thread.join()

    _at(monkeypatch, "before_send", look_from_another_connection)
    task = _runs(_submit(requester, device).pk)
    assert seen == {"status": OutboxStatus.IN_FLIGHT, "token": 1, "attempts": 1,
                    "attempt": (1, 1, AttemptOutcome.IN_FLIGHT), "intent": True}
    assert task.status == reducer.COMPLETED


def test_a_run_that_dies_before_the_request_leaves_its_row_to_a_dispatcher_after_the_lease(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    task, action = _killed_at(monkeypatch, "before_send", requester, device)
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_generation) == (OutboxStatus.IN_FLIGHT, 1)
    assert refadmin.requests(action.idempotency_key) == 0
    assert Task.objects.get(pk=task.pk).status == reducer.DISPATCHING
    assert outbox_dispatch_batch() == 0  # leased: no dispatcher takes it while the lease runs
    _expire_outbox_leases()
    assert outbox_dispatch_batch() == 1
    settle_receipts()
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.COMPLETED
    assert refadmin.effects(action.idempotency_key) == 1
    first, second = ActionAttempt.objects.filter(action=action).order_by("number")
    # the dead run's attempt may have reached the remote as far as anyone knows: never "not sent"
    assert (first.fencing_token, first.outcome) == (1, AttemptOutcome.UNKNOWN)
    assert (second.fencing_token, second.outcome) == (2, AttemptOutcome.RECEIPT)


def test_a_run_that_dies_after_the_ticket_was_made_gets_the_same_ticket_back(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    task, action = _killed_at(monkeypatch, "after_send", requester, device)
    assert refadmin.effects(action.idempotency_key) == 1
    assert Action.objects.get(pk=action.pk).status == ActionStatus.INTENDED  # nothing of the receipt committed
    _expire_outbox_leases()
    outbox_dispatch_batch()
    settle_receipts()
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.COMPLETED
    assert task.state["receipt"]["replayed"] is True
    assert refadmin.effects(action.idempotency_key) == 1 and refadmin.requests(action.idempotency_key) == 2
    assert len(refadmin.tickets()) == 1


def test_a_run_overtaken_by_a_dispatcher_is_fenced_out_and_the_task_gets_one_ticket(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    """The run stalls before its request past the row's lease; a dispatcher claims the row (token
    2), sends and records the receipt. The run's late request carries token 1: the service refuses
    it, and the run records only its own attempt and settles the task from the action's row."""

    def overtaken():
        _expire_outbox_leases()
        assert outbox_dispatch_batch() == 1

    _at(monkeypatch, "before_send", overtaken)
    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.COMPLETED
    action = Action.objects.get(task=task)
    assert refadmin.effects(action.idempotency_key) == 1 and refadmin.requests(action.idempotency_key) == 2
    first, second = ActionAttempt.objects.filter(action=action).order_by("number")
    assert (first.fencing_token, first.outcome) == (1, AttemptOutcome.FAILED)  # refused: an older token
    assert (second.fencing_token, second.outcome) == (2, AttemptOutcome.RECEIPT)
    assert _events(task).count("receipt.recorded") == 1
    assert OutboxMessage.objects.get(action=action).lease_generation == 2


def test_a_lost_answer_is_reconciled_by_key_not_sent_as_a_new_ticket(requester, device, kb, direct_on, refadmin):
    refadmin.fault("drop_after_commit")
    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.WAITING_RECONCILIATION
    action = Action.objects.get(task=task)
    assert action.status == ActionStatus.UNKNOWN
    actions_reconcile()
    task = _runs(task.pk)
    assert task.status == reducer.COMPLETED
    assert refadmin.effects(action.idempotency_key) == 1 and len(refadmin.tickets()) == 1


def test_a_refusal_for_now_leaves_the_row_to_the_dispatcher(requester, device, kb, direct_on, refadmin):
    refadmin.fault("fail_503")
    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.DISPATCHING
    action = Action.objects.get(task=task)
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_owner) == (OutboxStatus.PENDING, None)
    assert ActionAttempt.objects.get(action=action).outcome == AttemptOutcome.RETRYABLE
    OutboxMessage.objects.filter(pk=row.pk).update(available_at=row.created_at)
    assert outbox_dispatch_batch() == 1
    settle_receipts()
    assert Task.objects.get(pk=task.pk).status == reducer.COMPLETED
    assert refadmin.effects(action.idempotency_key) == 1


def test_a_cancel_while_the_request_is_out_keeps_the_ticket_and_asks_to_undo_it(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    task = _submit(requester, device)
    _at(monkeypatch, "after_send", lambda: task_cancel(principal=p(requester), task_id=task.pk,
                                                        reason="fixed itself"))
    task = _runs(task.pk)
    assert task.status in (reducer.CANCELLED, reducer.COMPENSATING)
    action = Action.objects.get(task=task, compensates__isnull=True)
    assert action.status == ActionStatus.SUCCEEDED
    assert task.state["receipt"]["external_id"] == action.external_id  # the ticket exists: recorded
    assert "task.completed" not in _events(task)
    assert task.state["compensation"] is not None  # its undoing is asked for, under its own approval
    assert "compensation.requested" in _events(task)
    assert refadmin.effects(action.idempotency_key) == 1


@pytest.mark.django_db(transaction=True)  # the messages a commit sends are sent after it
def test_a_comment_on_an_open_ticket_waits_for_a_dispatcher_in_its_tickets_order(
        requester, approver, device, kb, direct_on, refadmin, sent):
    """Only a row whose ordering key is its own is claimed at its intent: a write on an existing
    ticket shares its key with every other write on that ticket, and a concurrent intent could be
    writing an older one that no claim here would see."""
    from apps.approvals.models import ApprovalStatus
    from apps.approvals.services import approval_decide

    first = _runs(_submit(requester, device).pk)
    assert first.status == reducer.COMPLETED
    second = _runs(_submit(requester, device).pk)
    pending = ApprovalRequest.objects.filter(task=second, status=ApprovalStatus.PENDING).first()
    if pending is not None:
        approval_decide(principal=p(approver), approval_id=pending.pk, decision="approve", reason="ok")
        second = _runs(second.pk)
    comment = Action.objects.get(task=second)
    assert comment.tool == "ticket.comment"
    row = OutboxMessage.objects.get(action=comment)
    assert (row.status, row.lease_owner, row.lease_generation) == (OutboxStatus.PENDING, None, 0)
    assert second.status == reducer.DISPATCHING
    assert (queue.OUTBOX_DISPATCH,) in sent  # its commit kicked the dispatcher
    assert outbox_dispatch_batch() == 1
    settle_receipts()
    assert Task.objects.get(pk=second.pk).status == reducer.COMPLETED
    assert len(refadmin.tickets()) == 1


@pytest.mark.django_db(transaction=True)  # the cancel commits in the gap the intent's commit opens
def test_a_cancel_committed_after_the_intent_stops_the_request(requester, device, kb, direct_on, refadmin,
                                                               monkeypatch):
    from apps.tasks import store

    task = _submit(requester, device)
    real = store.failpoint

    def after_intent(name):
        if name == "after_commit:intent.committed":
            task_cancel(principal=p(requester), task_id=task.pk, reason="fixed itself")
        real(name)

    monkeypatch.setattr(store, "failpoint", after_intent)
    task = _runs(task.pk)
    action = Action.objects.get(task=task, compensates__isnull=True)
    assert refadmin.requests(action.idempotency_key) == 0
    assert task.status == reducer.CANCELLED
    assert action.status == ActionStatus.NOT_SENT
    [attempt] = ActionAttempt.objects.filter(action=action)
    assert attempt.outcome == AttemptOutcome.SKIPPED  # never left: not "may have reached the remote"
    assert OutboxMessage.objects.get(action=action).status == OutboxStatus.CANCELLED
    assert _events(task)[-2:] == ["cancel.requested", "dispatch.failed"]


@pytest.mark.django_db(transaction=True)
def test_a_cancel_waiting_for_the_runs_lock_is_seen_before_the_request(requester, device, kb, direct_on,
                                                                       refadmin, monkeypatch):
    """The requester cancels while the run's transaction (the reads' results, the draft, the
    intent) holds the task row: the cancel waits for that lock, which the intent's commit releases
    right before the request. The re-authorization first waits at the cancel gate, which the cancel
    entered before it waited for the row: it sees the task cancelled, and nothing is sent."""
    from apps.tasks import store

    task = _submit(requester, device)
    cancelled = threading.Event()
    real = store.failpoint

    def cancel_from_another_session():
        try:
            task_cancel(principal=p(requester), task_id=task.pk, reason="fixed itself")
            cancelled.set()
        finally:
            connection.close()

    def before_intent(name):
        if name == "before_commit:intent.committed" and not cancelled.is_set():
            threading.Thread(target=cancel_from_another_session).start()
            # the cancel is now waiting for the run's lock on the task row
            deadline = time.monotonic() + 5
            while not _waiting_for_a_lock() and time.monotonic() < deadline:
                time.sleep(0.02)
        real(name)

    monkeypatch.setattr(store, "failpoint", before_intent)
    task = _runs(task.pk)
    assert cancelled.is_set()
    action = Action.objects.get(task=task, compensates__isnull=True)
    events = _events(task)
    assert events.index("cancel.requested") > events.index("intent.committed")
    assert refadmin.requests(action.idempotency_key) == 0
    assert action.status == ActionStatus.NOT_SENT and task.status == reducer.CANCELLED


def _waiting_for_a_lock() -> bool:
    """Whether another session of this database waits for a lock (read from a session of its own)."""
    import psycopg

    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    with psycopg.connect(**params, autocommit=True) as other:
        return other.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                             "AND datname = current_database()").fetchone()[0] > 0


@pytest.mark.django_db(transaction=True)
def test_an_intent_committed_on_the_agent_pool_leaves_the_request_to_the_dispatcher(
        settings, requester, approver, device, kb, refservice, refadmin, sent):
    """After a person's approval the intent is committed by a run on the ``agent`` pool (model
    steps): it never waits for a ticket system there (a slow one would hold model slots)."""
    from apps.approvals.models import ApprovalStatus
    from apps.approvals.services import approval_decide

    settings.FAULTDESK = {**settings.FAULTDESK, "OUTBOX_DIRECT_DELIVERY": True}
    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.WAITING_APPROVAL
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    agent_run(task_id=task.pk)  # the agent pool's run
    action = Action.objects.get(task=task)
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_owner) == (OutboxStatus.PENDING, None)
    assert refadmin.requests(action.idempotency_key) == 0
    assert (queue.OUTBOX_DISPATCH,) in sent
    assert outbox_dispatch_batch() == 1
    settle_receipts()
    assert Task.objects.get(pk=task.pk).status == reducer.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_a_run_that_ends_before_its_request_hands_the_row_to_the_dispatcher_at_once(
        requester, device, kb, direct_on, refadmin, monkeypatch, sent):
    """A run that stops right after its intent (its step limit) never sent the request and knows
    it: the attempt is closed as not sent and the row is the dispatcher's now, not after its lease."""
    from apps.agent import runner

    monkeypatch.setattr(runner, "deliver_directly", lambda task, lease: False)  # the run ends at DISPATCHING
    task = _runs(_submit(requester, device).pk, rounds=2)
    action = Action.objects.get(task=task)
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_owner) == (OutboxStatus.PENDING, None)
    assert (queue.OUTBOX_DISPATCH,) in sent
    [attempt] = ActionAttempt.objects.filter(action=action)
    assert attempt.outcome == AttemptOutcome.SKIPPED
    assert outbox_dispatch_batch() == 1
    settle_receipts()
    assert Task.objects.get(pk=task.pk).status == reducer.COMPLETED
    first, second = ActionAttempt.objects.filter(action=action).order_by("number")
    assert (first.outcome, second.outcome, second.fencing_token) == (AttemptOutcome.SKIPPED,
                                                                     AttemptOutcome.RECEIPT, 2)
    assert refadmin.requests(action.idempotency_key) == 1


@pytest.mark.django_db(transaction=True)
def test_a_re_authorization_that_fails_hands_the_unsent_row_to_the_dispatcher(
        requester, device, kb, direct_on, refadmin, monkeypatch):
    from django.db import OperationalError

    def lock_timeout(send):
        raise OperationalError("canceling statement due to lock timeout")

    monkeypatch.setattr(direct, "_authorized_now", lock_timeout)
    task = _runs(_submit(requester, device).pk)
    action = Action.objects.get(task=task)
    assert refadmin.requests(action.idempotency_key) == 0
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_owner) == (OutboxStatus.PENDING, None)
    assert ActionAttempt.objects.get(action=action).outcome == AttemptOutcome.SKIPPED
    monkeypatch.undo()
    assert outbox_dispatch_batch() == 1
    settle_receipts()
    assert Task.objects.get(pk=task.pk).status == reducer.COMPLETED
    assert refadmin.effects(action.idempotency_key) == 1


def test_a_ticket_system_without_idempotency_is_left_to_the_dispatcher(tenant, requester, device, kb, direct_on,
                                                                       monkeypatch):
    """django-helpdesk cannot be asked to replay a key: its key is looked up before any resend, and
    a cancel waiting for the run's lock could slip past a read right after the intent's commit. Its
    rows are never delivered directly."""
    from apps.tickets.helpdesk import HelpdeskConnector

    tenant.ticket_system = HelpdeskConnector.name
    tenant.save(update_fields=["ticket_system"])
    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.DISPATCHING
    action = Action.objects.get(task=task)
    assert action.connector == HelpdeskConnector.name
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_owner) == (OutboxStatus.PENDING, None)
    assert not ActionAttempt.objects.filter(action=action).exists()


def _slow_cancel(task_id, seconds: float):
    """Start, on another thread and session, a cancel of ``task_id`` that enters the cancel gate at
    once and reaches the task row only ``seconds`` later (a backend slow to be scheduled). Returns
    ``(entered, done)`` events."""
    from django.db import transaction

    from apps.tasks.cancel_gate import cancel_gate_enter
    from apps.tasks.store import task_append_with_retry

    entered, done = threading.Event(), threading.Event()

    def cancel():
        try:
            with transaction.atomic():
                cancel_gate_enter(task_id)
                entered.set()
                time.sleep(seconds)
                task_append_with_retry(task_id=task_id, event_type="cancel.requested",
                                       payload_fn=lambda t: {"reason": "slow"}, actor="user:slow")
            done.set()
        finally:
            connection.close()

    threading.Thread(target=cancel).start()
    assert entered.wait(5)
    return entered, done


def _slow_cancel_at_the_intent(monkeypatch, task_id, seconds: float):
    """:func:`_slow_cancel`, started while the run's transaction is about to record the intent."""
    from apps.tasks import store

    real, started = store.failpoint, []

    def before_intent(name):
        if name == "before_commit:intent.committed" and not started:
            started.append(_slow_cancel(task_id, seconds))
        real(name)

    monkeypatch.setattr(store, "failpoint", before_intent)
    return started


@pytest.mark.django_db(transaction=True)
def test_a_cancel_already_begun_is_waited_for_however_slow_it_is(requester, device, kb, direct_on, refadmin,
                                                                 monkeypatch):
    """A cancel that has begun — it took the cancel gate — but is slow to reach the task row (its
    backend not scheduled, say) is still waited for by the re-authorization before the request: the
    gate, not the row's lock, orders them."""
    task = _submit(requester, device)
    started = _slow_cancel_at_the_intent(monkeypatch, task.pk, 1.0)
    task = _runs(task.pk)
    assert started and started[0][1].is_set()
    action = Action.objects.get(task=task, compensates__isnull=True)
    assert refadmin.requests(action.idempotency_key) == 0
    assert action.status == ActionStatus.NOT_SENT and task.status == reducer.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_a_cancel_slower_than_the_lock_timeout_still_stops_the_request(requester, device, kb, direct_on,
                                                                       refadmin, monkeypatch):
    """Past the lock timeout the re-authorization gives up and hands the row to the dispatcher,
    whose re-authorization waits at the same gate: nothing is sent while the cancel is under way,
    and once it has committed the row is closed as not sent."""
    from django.db import transaction

    from apps.outbox import dispatch
    from apps.tasks.cancel_gate import cancels_in_flight_wait

    def impatient(*task_ids):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '300ms'")
            cancels_in_flight_wait(*task_ids)

    monkeypatch.setattr(direct, "cancels_in_flight_wait", impatient)
    monkeypatch.setattr(dispatch, "cancels_in_flight_wait", impatient)
    task = _submit(requester, device)
    started = _slow_cancel_at_the_intent(monkeypatch, task.pk, 2.5)
    _runs(task.pk, rounds=1)
    action = Action.objects.get(task=task, compensates__isnull=True)
    assert refadmin.requests(action.idempotency_key) == 0
    row = OutboxMessage.objects.get(action=action)
    assert (row.status, row.lease_owner) == (OutboxStatus.PENDING, None)  # handed back, not sent
    from django.db import OperationalError
    with pytest.raises(OperationalError):
        outbox_dispatch_batch()  # the dispatcher waits at the gate too, and does not send
    assert refadmin.requests(action.idempotency_key) == 0
    assert started[0][1].wait(10)  # the cancel commits
    _expire_outbox_leases()
    assert outbox_dispatch_batch() == 1
    assert refadmin.requests(action.idempotency_key) == 0
    assert Action.objects.get(pk=action.pk).status == ActionStatus.NOT_SENT
    assert Task.objects.get(pk=task.pk).status == reducer.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_the_dispatcher_waits_for_a_cancel_already_begun(requester, device, kb, refservice, refadmin, tenant,
                                                         monkeypatch):
    """Direct delivery off: a dispatcher that claims the row right after the intent's commit still
    sees a cancel that began before it (it waits at the cancel gate)."""
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "ticket.create": {"requires_approval": False, "ttl_minutes": 60}})
    task = _submit(requester, device)
    started = _slow_cancel_at_the_intent(monkeypatch, task.pk, 1.0)
    task = _runs(task.pk)
    assert task.status == reducer.DISPATCHING and started
    outbox_dispatch_batch()  # at once, while the cancel is still on its way
    action = Action.objects.get(task=task, compensates__isnull=True)
    assert refadmin.requests(action.idempotency_key) == 0
    assert Action.objects.get(pk=action.pk).status == ActionStatus.NOT_SENT
    assert Task.objects.get(pk=task.pk).status == reducer.CANCELLED


def test_a_refused_cancel_keeps_its_record(requester, device, kb, direct_on, refadmin):
    """The cancel's own transaction (it holds the cancel gate) still commits the record of a cancel
    δ refused: a task already completed cannot be cancelled, and the attempt is on file."""
    from apps.core.errors import Conflict
    from apps.events.models import RefusedEvent

    task = _runs(_submit(requester, device).pk)
    assert task.status == reducer.COMPLETED
    with pytest.raises(Conflict):
        task_cancel(principal=p(requester), task_id=task.pk, reason="too late")
    assert RefusedEvent.objects.filter(task=task, type="cancel.requested").exists()
