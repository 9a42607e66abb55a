"""Batched delivery (DESIGN.md §6): a claimed batch's attempt rows are committed before any of
its requests leaves, its requests go out concurrently, its receipts are recorded in one
transaction — and a crash at each of those boundaries still ends with one ticket per idempotency
key, every receipt recorded, and per-ticket order kept. The reference ticket service is a real
HTTP server on loopback."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.agent.runner import agent_run, context_read
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.outbox import dispatch as outbox
from apps.outbox import sending
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from tests.conftest import p, reads_run, settle_receipts
from tests.factories import DeviceFactory

SYMPTOMS = [
    "Fuser error after warm-up, pages come out smeared with unfused toner.",
    "打印机预热后报定影器错误，纸上的碳粉一擦就掉。",
    "Paper jam in tray 2 every few pages, the rollers look worn.",
]


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing after it runs, nothing is cleaned up."""


@pytest.fixture
def committed_three(tenant, requester, approver, kb, refservice):
    """Three tasks on three devices, each with its approved ``ticket.create`` committed and its
    outbox row PENDING, nothing sent."""
    tasks = []
    for i, symptom in enumerate(SYMPTOMS):
        device = DeviceFactory(tenant=tenant, asset_tag=f"PRN-05{i}")
        task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=symptom).task
        for _ in range(30):  # the agent and tools steps only: nothing of the outbox runs yet
            agent_run(task_id=task.pk)
            context_read(task_id=task.pk)
            reads_run(task.pk)  # the reads, each an activity of its own
            if ApprovalRequest.objects.filter(task=task, status=ApprovalStatus.PENDING).exists():
                break
        approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
        approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
        agent_run(task_id=task.pk)
        tasks.append(Task.objects.get(pk=task.pk))
    assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() == 3
    return tasks


def _dies_at(monkeypatch, module, point: str, call) -> None:
    """Run ``call()`` with ``module``'s failpoint ``point`` standing for SIGKILL there."""

    def failpoint(name):
        if name == point:
            raise Killed

    with monkeypatch.context() as mp:
        mp.setattr(module, "failpoint", failpoint)
        with pytest.raises(Killed):
            call()


def _as_if_minutes_passed(task_ids) -> None:
    """Move the tasks' and their actions' last writes five minutes back: the idle time after which
    the lease sweeper acts on a task whose receipt its action's row holds."""
    then = timezone.now() - timedelta(minutes=5)
    Task.objects.filter(pk__in=task_ids).update(updated_at=then)
    Action.objects.filter(task_id__in=task_ids).update(updated_at=then)


def _expire_leases():
    for row in OutboxMessage.objects.filter(status=OutboxStatus.IN_FLIGHT):
        OutboxMessage.objects.filter(pk=row.pk).update(lease_expires_at=row.created_at)


def _assert_one_ticket_per_key(tasks, refadmin):
    settle_receipts()  # the agent worker's half: the message the dispatcher's commit sent
    actions = list(Action.objects.filter(task__in=tasks, tool="ticket.create"))
    assert len(actions) == 3
    for action in actions:
        assert action.status == ActionStatus.SUCCEEDED
        assert refadmin.effects(action.idempotency_key) == 1
        assert OutboxMessage.objects.get(action=action).status == OutboxStatus.DELIVERED
        [event] = TaskEvent.objects.filter(task_id=action.task_id, type="receipt.recorded")
        assert event.payload["receipt"]["external_id"] == action.external_id
        assert action.receipt == event.payload["receipt"]
        assert action.external_version == event.payload["receipt"]["version"] == 1
    assert len(refadmin.tickets()) == 3
    return actions


def test_a_batch_sends_each_row_once_and_records_its_receipts_together(committed_three, refadmin,
                                                                         django_assert_max_num_queries):
    before = {t.pk: t.version for t in committed_three}
    with django_assert_max_num_queries(40):  # one row alone took about 25 statements
        assert outbox.outbox_dispatch_batch() == 3
    # The dispatcher's commit holds the receipts on the rows; the tasks have not moved yet.
    assert Action.objects.filter(status=ActionStatus.SUCCEEDED).count() == 3
    assert {t.pk: t.version for t in Task.objects.filter(pk__in=before)} == before
    actions = _assert_one_ticket_per_key(committed_three, refadmin)
    for action in actions:
        [attempt] = ActionAttempt.objects.filter(action=action)
        assert (attempt.number, attempt.outcome) == (1, AttemptOutcome.RECEIPT)
        assert attempt.fencing_token == OutboxMessage.objects.get(action=action).lease_generation
        task = Task.objects.get(pk=action.task_id)
        # the receipt and the completion it leads to, at the next two seqs, in the same commit;
        # the materialized state follows them
        assert task.version == before[task.pk] + 2
        receipt, completed = TaskEvent.objects.filter(task=task, seq__gt=before[task.pk]).order_by("seq")
        assert (receipt.type, completed.type) == ("receipt.recorded", "task.completed")
        assert completed.payload["reason"] == "ticket_created"
        assert action.external_id in completed.payload["answer"]["knowledge"]["text"]
        assert task.status == reducer.COMPLETED and task.state["receipt"]["external_id"] == action.external_id
        assert task_replay(task).ok


def test_a_crash_after_the_requests_left_resends_with_the_same_keys(committed_three, refadmin, monkeypatch):
    """The dispatcher dies after the remote created the tickets, before any receipt was
    recorded: the next claim resends each with its key and records the stored tickets."""

    def die(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as mp:
        mp.setattr(sending, "receipts_record_batch", die)
        with pytest.raises(Killed):
            outbox.outbox_dispatch_batch()
    assert ActionAttempt.objects.filter(outcome=AttemptOutcome.IN_FLIGHT).count() == 3
    assert len(refadmin.tickets()) == 3
    assert not TaskEvent.objects.filter(task__in=committed_three, type="receipt.recorded").exists()
    _expire_leases()
    assert outbox.outbox_dispatch_batch() == 3
    for action in _assert_one_ticket_per_key(committed_three, refadmin):
        first, second = ActionAttempt.objects.filter(action=action).order_by("number")
        assert first.outcome == AttemptOutcome.UNKNOWN  # no report from the dead dispatcher
        assert second.outcome == AttemptOutcome.RECEIPT
        assert second.fencing_token > first.fencing_token
        assert TaskEvent.objects.get(task_id=action.task_id, type="receipt.recorded").payload["receipt"]["replayed"]


def test_a_crash_between_the_attempt_rows_and_the_sends_makes_one_ticket_each(committed_three, refadmin,
                                                                              monkeypatch):
    """The attempt rows are durable before any request leaves; the dispatcher dies at its
    ``before_send`` failpoint; the next claim sends each row once."""

    _dies_at(monkeypatch, sending, "before_send", outbox.outbox_dispatch_batch)
    assert ActionAttempt.objects.filter(outcome=AttemptOutcome.IN_FLIGHT).count() == 3
    _expire_leases()
    outbox.outbox_dispatch_batch()
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_a_row_whose_lease_passed_on_after_the_claim_is_not_sent_by_the_old_holder(committed_three, refadmin,
                                                                                   monkeypatch):
    """Between A's claim and its attempt rows, one row's lease expires and B claims it: A writes
    no attempt for that row and sends only the other two; B's delivery is the only one."""
    claim = outbox.outbox_claim_batch
    taken = {}

    def claim_then_lose_one(*, owner, limit, now=None):
        rows = claim(owner=owner, limit=limit, now=now)
        if owner != "B" and not taken:
            _expire_leases()
            OutboxMessage.objects.exclude(pk=rows[0].pk).update(lease_expires_at=None)
            [row_b] = claim(owner="B", limit=1)
            taken["row"] = row_b
        return rows

    monkeypatch.setattr(outbox, "outbox_claim_batch", claim_then_lose_one)
    assert outbox.outbox_dispatch_batch() == 3
    row_b = taken["row"]
    assert not ActionAttempt.objects.filter(action_id=row_b.action_id).exists()
    assert Action.objects.filter(status=ActionStatus.SUCCEEDED).count() == 2
    assert outbox.outbox_deliver(message_id=row_b.pk, fencing_token=row_b.lease_generation, owner="B") == "receipt"
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_rows_of_one_ordering_key_never_share_a_batch(committed_three, refadmin):
    """Two rows for one ticket: the newer is not claimed while the older is undelivered, so
    concurrent sending keeps their order."""
    older, newer, other = OutboxMessage.objects.order_by("created_at")
    OutboxMessage.objects.filter(pk=newer.pk).update(ordering_key=older.ordering_key)
    assert outbox.outbox_dispatch_batch() == 2
    assert {m.pk for m in OutboxMessage.objects.filter(status=OutboxStatus.DELIVERED)} == {older.pk, other.pk}
    assert outbox.outbox_dispatch_batch() == 1
    older.refresh_from_db()
    newer.refresh_from_db()
    assert older.delivered_at < ActionAttempt.objects.get(action_id=newer.action_id).started_at
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_a_cancelled_row_takes_the_one_row_path_and_the_rest_go_together(committed_three, requester, refadmin):
    from apps.tasks.services import task_cancel

    cancelled = committed_three[1]
    task_cancel(principal=p(requester), task_id=cancelled.pk, reason="fixed itself")
    assert outbox.outbox_dispatch_batch() == 3
    row = OutboxMessage.objects.get(action__task=cancelled)
    assert row.status == OutboxStatus.CANCELLED
    assert not ActionAttempt.objects.filter(action__task=cancelled).exists()
    sent = Action.objects.filter(status=ActionStatus.SUCCEEDED)
    assert {a.task_id for a in sent} == {committed_three[0].pk, committed_three[2].pk}
    assert len(refadmin.tickets()) == 2


def test_one_drain_claims_batch_after_batch_until_one_comes_back_short(committed_three, refadmin):
    # Batches of one: three full batches, then an empty claim ends the loop.
    assert outbox.outbox_drain(limit=1) == 3
    _assert_one_ticket_per_key(committed_three, refadmin)
    assert outbox.outbox_drain(limit=1) == 0


def test_one_drain_delivers_a_row_then_the_successor_its_delivery_unblocked(committed_three, refadmin):
    """A row behind an older one of its ordering key gets no kick of its own (its intent's kick was
    coalesced into the run that delivered the older row), so the drain that delivered the older row
    goes on to claim it, in order."""
    older, newer, other = OutboxMessage.objects.order_by("created_at")
    OutboxMessage.objects.filter(pk=newer.pk).update(ordering_key=older.ordering_key)
    assert outbox.outbox_drain() == 3  # a short batch of two, then the successor alone
    assert OutboxMessage.objects.filter(status=OutboxStatus.DELIVERED).count() == 3
    older.refresh_from_db()
    assert older.delivered_at < ActionAttempt.objects.get(action_id=newer.action_id).started_at
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_a_successor_still_blocked_ends_the_drain_without_a_second_attempt(committed_three, refadmin, monkeypatch):
    """The older row's send fails retryably (back to PENDING with backoff): its successor stays
    blocked, the drain stops after one empty claim, and the older row got exactly one attempt."""
    from apps.core import tool_errors as errors
    from apps.tickets.connectors import ReferenceTicketConnector

    older, newer, other = OutboxMessage.objects.order_by("created_at")
    OutboxMessage.objects.filter(pk=newer.pk).update(ordering_key=older.ordering_key)
    real, real_many = ReferenceTicketConnector.execute, ReferenceTicketConnector.create_tickets
    refused_key = older.action.idempotency_key

    def refuse_older(self, **kwargs):  # runs on a sender thread: no database here
        if kwargs["idempotency_key"] == refused_key:
            raise errors.TemporarilyUnavailable("busy")
        return real(self, **kwargs)

    def refuse_older_in_batch(self, items, **kwargs):  # the same, when the rows go in one request
        sent = iter(real_many(self, [i for i in items if i[0] != refused_key], **kwargs))
        return [errors.TemporarilyUnavailable("busy") if i[0] == refused_key else next(sent) for i in items]

    monkeypatch.setattr(ReferenceTicketConnector, "execute", refuse_older)
    monkeypatch.setattr(ReferenceTicketConnector, "create_tickets", refuse_older_in_batch)
    monkeypatch.setattr("apps.outbox.settlement.backoff_delay", lambda attempt, rng=None: 60.0)
    assert outbox.outbox_drain() == 2
    older.refresh_from_db()
    newer.refresh_from_db()
    assert older.status == OutboxStatus.PENDING and older.attempts == 1
    assert newer.status == OutboxStatus.PENDING and newer.attempts == 0


def test_a_drain_stops_at_its_time_cap_and_leaves_the_rest_pending(committed_three, refadmin):
    assert outbox.outbox_drain(limit=1, max_seconds=0) == 1
    assert OutboxMessage.objects.filter(status=OutboxStatus.DELIVERED).count() == 1
    assert OutboxMessage.objects.filter(status=OutboxStatus.PENDING).count() == 2


def test_an_answer_that_cannot_be_composed_never_costs_a_receipt_its_commit(committed_three, refadmin, monkeypatch):
    """The completion rides in the transaction that settles the receipt on the task; if composing
    the answer fails, the receipts are recorded anyway (the task stays in DISPATCHING for the
    agent's completion step)."""
    import apps.tasks.answer as answer

    def broken(state):
        raise RuntimeError("the answer cannot be composed")

    monkeypatch.setattr(answer, "answer_compose", broken)
    assert outbox.outbox_dispatch_batch() == 3
    assert settle_receipts() == 3
    for task in committed_three:
        row = Task.objects.get(pk=task.pk)
        assert row.status == reducer.DISPATCHING and row.state["receipt"] is not None
        assert TaskEvent.objects.get(task=row, seq=row.version).type == "receipt.recorded"
    monkeypatch.undo()
    for task in committed_three:
        agent_run(task_id=task.pk)  # the agent's completion step composes it
        assert Task.objects.get(pk=task.pk).status == reducer.COMPLETED


# --- the two halves of a batch's receipts: the outbox's rows, then the tasks -----------------------

def test_the_dispatchers_commit_sends_one_settlement_message_naming_the_batchs_tasks(
        committed_three, refadmin, monkeypatch, django_capture_on_commit_callbacks):
    from apps.core import queue

    sent = []
    monkeypatch.setattr(queue, "send_now", lambda name, *args: sent.append((name, args)))
    with django_capture_on_commit_callbacks(execute=True):
        assert outbox.outbox_dispatch_batch() == 3
    [settle] = [(name, args) for name, args in sent if name == queue.RECEIPTS_SETTLE]
    assert sorted(settle[1]) == sorted(str(t.pk) for t in committed_three)
    # the message runs the tasks' half
    from apps.outbox.tasks import settle_receipts as settle_task

    assert settle_task(*settle[1]) == 3
    assert all(Task.objects.get(pk=t.pk).status == reducer.COMPLETED for t in committed_three)


def test_a_repeated_settlement_message_changes_nothing(committed_three, refadmin):
    from apps.events.models import RefusedEvent
    from apps.outbox.receipts import receipts_settle

    outbox.outbox_dispatch_batch()
    ids = [t.pk for t in committed_three]
    assert receipts_settle(ids) == 3
    versions = {t.pk: t.version for t in Task.objects.filter(pk__in=ids)}
    assert receipts_settle(ids) == 0
    assert {t.pk: t.version for t in Task.objects.filter(pk__in=ids)} == versions
    assert not RefusedEvent.objects.filter(task_id__in=ids).exists()
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_a_crash_while_settling_leaves_the_receipts_on_the_rows_and_the_next_run_settles_them(
        committed_three, refadmin, monkeypatch):
    """The worker dies inside the tasks' half, before its commit: the tasks are as they were, the
    receipts stay on the rows (nothing is sent again), and the lease sweeper's agent step
    (:func:`apps.agent.runner.completion_on_receipt`) settles each task from its row."""
    import apps.tasks.batch as batch
    from apps.agent.sweeper import tasks_needing_work
    from apps.outbox.receipts import receipts_settle

    outbox.outbox_dispatch_batch()
    before = {t.pk: t.version for t in Task.objects.filter(pk__in=[t.pk for t in committed_three])}
    _dies_at(monkeypatch, batch, "before_commit:receipt.recorded", lambda: receipts_settle(list(before)))
    assert {t.pk: t.version for t in Task.objects.filter(pk__in=before)} == before
    assert Action.objects.filter(status=ActionStatus.SUCCEEDED).count() == 3
    _as_if_minutes_passed(before)
    found = {task_id for _, task_id in tasks_needing_work(now=timezone.now(), idle=timedelta(seconds=10))}
    assert {str(pk) for pk in before} <= found
    for task_id in before:
        agent_run(task_id=task_id)
        task = Task.objects.get(pk=task_id)
        assert task.status == reducer.COMPLETED
        assert [e.type for e in TaskEvent.objects.filter(task=task, seq__gt=before[task_id]).order_by("seq")] == [
            "receipt.recorded", "task.completed"]
    actions = _assert_one_ticket_per_key(committed_three, refadmin)
    assert all(refadmin.requests(a.idempotency_key) == 1 for a in actions)


def test_a_receipt_for_a_task_cancelled_before_its_settlement_is_kept_and_the_task_stays_cancelled(
        committed_three, requester, refadmin):
    from apps.outbox.receipts import receipts_settle
    from apps.tasks.services import task_cancel

    outbox.outbox_dispatch_batch()
    cancelled = committed_three[0]
    task_cancel(principal=p(requester), task_id=cancelled.pk, reason="fixed itself")
    assert receipts_settle([t.pk for t in committed_three]) == 3
    task = Task.objects.get(pk=cancelled.pk)
    assert task.status == reducer.CANCELLED and task.state["receipt"] is not None
    types = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))
    assert types.index("cancel.requested") < types.index("receipt.recorded")
    assert "task.completed" not in types
    assert all(Task.objects.get(pk=t.pk).status == reducer.COMPLETED for t in committed_three[1:])



@pytest.mark.allow_divergence
def test_the_batch_reads_a_cancel_request_from_the_state_without_reading_the_state(committed_three, refadmin):
    """The batch reads the tasks without their states; the cancel flag is read as one key. A state
    that records a cancel request (every reducer also moves the status to CANCELLED; the flag alone
    is set here by hand) keeps that row from being sent."""
    from django.db import connection

    flagged = committed_three[2]
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks_task SET state = jsonb_set(state, '{cancel_requested}', 'true') WHERE id = %s",
                       [flagged.pk])
    assert outbox.outbox_dispatch_batch() == 3
    assert OutboxMessage.objects.get(action__task=flagged).status == OutboxStatus.CANCELLED
    assert {a.task_id for a in Action.objects.filter(status=ActionStatus.SUCCEEDED)} == {
        committed_three[0].pk, committed_three[1].pk}
    assert len(refadmin.tickets()) == 2


def test_a_task_cancelled_between_the_halves_whose_message_is_lost_is_settled_and_compensated(
        committed_three, requester, refadmin):
    """The receipts are on the rows, the task is cancelled, and the settle message never comes:
    the sweeper finds the cancelled task (terminal, yet claimable while its receipt is unrecorded),
    the agent records the receipt from the row, settles the reservation and asks for the
    compensation of the ticket created anyway."""
    from apps.agent.sweeper import tasks_needing_work
    from apps.tasks.services import task_cancel

    outbox.outbox_dispatch_batch()
    cancelled = committed_three[0]
    task_cancel(principal=p(requester), task_id=cancelled.pk, reason="fixed itself")
    assert Task.objects.get(pk=cancelled.pk).budget_reserved > 0
    # a message waiting behind a backlog is given its time first
    assert str(cancelled.pk) not in {i for _, i in tasks_needing_work(now=timezone.now(), idle=timedelta(0))}
    _as_if_minutes_passed([cancelled.pk])
    assert (reducer.CANCELLED, str(cancelled.pk)) in tasks_needing_work(now=timezone.now(), idle=timedelta(seconds=10))
    agent_run(task_id=cancelled.pk)
    task = Task.objects.get(pk=cancelled.pk)
    assert task.state["receipt"] is not None and task.budget_reserved == 0
    # the ticket created anyway is to be closed: the compensation is asked for
    assert task.status == reducer.COMPENSATING and task.state["compensation"] is not None
    types = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))
    assert types.index("cancel.requested") < types.index("receipt.recorded") < types.index("compensation.requested")


def test_the_audit_accepts_a_receipt_on_its_way_and_nothing_else(committed_three, refadmin):
    from apps.actions.audit import task_actions_audit

    outbox.outbox_dispatch_batch()
    task = Task.objects.get(pk=committed_three[0].pk)
    assert task_actions_audit(task) == []  # the row holds the receipt; the task's half is to come
    for status, action_status in ((reducer.DISPATCHING, "UNKNOWN"), (reducer.FAILED, "INTENDED")):
        task.status = status
        task.state = {**task.state, "status": status, "action": {**task.state["action"], "status": action_status}}
        assert task_actions_audit(task), (status, action_status)


@pytest.mark.allow_divergence
def test_a_succeeded_row_that_is_not_the_states_current_action_makes_no_task_claimable(committed_three,
                                                                                        requester, refadmin):
    """The sweeper and the claim look for the same row the agent's step reads (the state's current
    action): a SUCCEEDED row of another action never makes a task claimable or re-queued for ever."""
    import uuid

    from django.db import connection

    from apps.agent.sweeper import tasks_needing_work
    from apps.tasks.leases import task_claim
    from apps.tasks.services import task_cancel

    outbox.outbox_dispatch_batch()
    task = committed_three[0]
    task_cancel(principal=p(requester), task_id=task.pk, reason="fixed itself")
    with connection.cursor() as cursor:  # by hand: no path writes such a state
        cursor.execute("UPDATE tasks_task SET state = jsonb_set(state, '{action,id}', to_jsonb(%s::text)) "
                       "WHERE id = %s", [str(uuid.uuid4()), task.pk])
    _as_if_minutes_passed([task.pk])
    assert str(task.pk) not in {i for _, i in tasks_needing_work(now=timezone.now(), idle=timedelta(seconds=10))}
    assert task_claim(task_id=task.pk) is None


def _spy_batch_requests(monkeypatch) -> list[list[tuple]]:
    """Record the items of every ``POST /ticket-batches`` the connector sends (and send it)."""
    from apps.tickets.connectors import ReferenceTicketConnector

    real, sent = ReferenceTicketConnector.create_tickets, []

    def spy(self, items, **kwargs):
        sent.append(list(items))
        return real(self, items, **kwargs)

    monkeypatch.setattr(ReferenceTicketConnector, "create_tickets", spy)
    return sent


def test_the_new_tickets_of_a_batch_go_in_one_request_each_with_its_own_key_and_token(committed_three, refadmin,
                                                                                      monkeypatch):
    sent = _spy_batch_requests(monkeypatch)
    assert outbox.outbox_dispatch_batch() == 3
    [items] = sent
    rows = {m.action.idempotency_key: m for m in OutboxMessage.objects.select_related("action")}
    assert sorted(key for key, _, _ in items) == sorted(rows)
    for key, token, params in items:
        assert token == rows[key].lease_generation
        assert params == rows[key].action.params  # exactly the approved parameters (h(a) checked at send)
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_a_batch_larger_than_the_remotes_batch_size_is_split_evenly(committed_three, refadmin, monkeypatch, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_BATCH_SIZE": 2}
    sent = _spy_batch_requests(monkeypatch)
    assert outbox.outbox_dispatch_batch() == 3
    # two requests: a batch of two, and the third row alone (a single POST /tickets)
    assert [len(items) for items in sent] == [2]
    for action in _assert_one_ticket_per_key(committed_three, refadmin):
        assert refadmin.requests(action.idempotency_key) == 1


def test_a_crash_after_the_batch_was_answered_resends_the_same_keys_once_each(committed_three, refadmin,
                                                                               monkeypatch):
    """The dispatcher dies at ``after_send``: the batch created the tickets, nothing recorded them.
    After the leases expire the rows are resent with the same keys and higher tokens; the remote
    replays each ticket."""
    _dies_at(monkeypatch, sending, "after_send", outbox.outbox_dispatch_batch)
    assert len(refadmin.tickets()) == 3
    assert ActionAttempt.objects.filter(outcome=AttemptOutcome.IN_FLIGHT).count() == 3
    _expire_leases()
    assert outbox.outbox_dispatch_batch() == 3
    for action in _assert_one_ticket_per_key(committed_three, refadmin):
        assert TaskEvent.objects.get(task_id=action.task_id, type="receipt.recorded").payload["receipt"]["replayed"]


def test_a_batch_whose_answer_was_lost_is_reconciled_to_one_ticket_each(committed_three, refadmin):
    """The remote committed the whole batch and the connection closed unanswered: every row is an
    unknown outcome (never "not executed"), and reconciliation by key records each stored ticket."""
    from apps.outbox import unknown_outcomes

    refadmin.fault("drop_after_commit")
    assert outbox.outbox_dispatch_batch() == 3
    assert OutboxMessage.objects.filter(status=OutboxStatus.UNKNOWN).count() == 3
    assert Action.objects.filter(status=ActionStatus.UNKNOWN).count() == 3
    assert len(refadmin.tickets()) == 3
    unknown_outcomes.actions_reconcile()
    _assert_one_ticket_per_key(committed_three, refadmin)


def test_each_row_of_a_batch_is_settled_by_its_own_answer(committed_three, refadmin):
    """One item refused for now (503), the others created: the refused row goes back to PENDING
    with backoff and is sent again with its key; the others are delivered at once."""
    refadmin.fault("fail_503", count=1)
    assert outbox.outbox_dispatch_batch() == 3
    assert OutboxMessage.objects.filter(status=OutboxStatus.DELIVERED).count() == 2
    [waiting] = OutboxMessage.objects.filter(status=OutboxStatus.PENDING)
    assert waiting.attempts == 1 and waiting.last_error
    OutboxMessage.objects.filter(pk=waiting.pk).update(available_at=timezone.now())
    assert outbox.outbox_dispatch_batch() == 1
    _assert_one_ticket_per_key(committed_three, refadmin)
