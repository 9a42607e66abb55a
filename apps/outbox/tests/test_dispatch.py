"""Stalled and crashed dispatchers against cancel, invalidated approvals and the reconciler
(DESIGN.md §6, §12 invariants 2 and 3; ADR 0009).

"Not executed" may only be recorded when it is true. These tests stall dispatcher A at its real
``before_send`` / ``after_send`` failpoints (the failpoint is replaced by a hook that runs the
rest of the world: lease expiry, cancel, device change, dispatcher B) and then let A carry on
with its old fencing token. The reference ticket service is a real HTTP server on loopback.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.core import tool_errors as errors
from apps.devices.services import device_update_state
from apps.events.models import RefusedEvent, TaskEvent
from apps.outbox import dispatch as outbox
from apps.outbox import settlement, unknown_outcomes
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_submit
from apps.tasks.store import task_append_with_retry
from apps.tickets.connectors import ReferenceTicketConnector
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing after the failpoint runs, nothing is cleaned up."""


def _expire_lease(message_id):
    row = OutboxMessage.objects.get(pk=message_id)
    OutboxMessage.objects.filter(pk=message_id).update(lease_expires_at=row.created_at)


def _stall_at(monkeypatch, name, hook):
    """Replace the dispatcher's failpoint: at ``name`` (first time only) run ``hook()``."""
    fired = []

    def failpoint(point):
        if point == name and not fired:
            fired.append(point)
            hook()

    monkeypatch.setattr(outbox, "failpoint", failpoint)
    return fired


def _dispatch_b(results):
    """Dispatcher B: claim the (expired) row with the next fencing token and deliver it."""
    [row] = outbox.outbox_claim_batch(owner="B", limit=1)
    results["b_token"] = row.lease_generation
    with pytest.MonkeyPatch.context() as mp:  # B itself does not stall
        mp.setattr(outbox, "failpoint", lambda point: None)
        results["b"] = outbox.outbox_deliver(message_id=row.pk, fencing_token=row.lease_generation, owner="B")


def _run_a():
    [row] = outbox.outbox_claim_batch(owner="A", limit=1)
    return row, outbox.outbox_deliver(message_id=row.pk, fencing_token=row.lease_generation, owner="A")


def test_stalled_dispatcher_cannot_send_after_a_cancel_closed_the_row(committed, requester, refadmin, monkeypatch):
    """F2: A writes its attempt and stalls before sending; the task is cancelled and B closes the
    row as not sent. When A wakes and sends with its old token, the remote refuses it."""
    results = {}

    def world():
        message = OutboxMessage.objects.get(action__task=committed)
        _expire_lease(message.pk)
        task_cancel(principal=p(requester), task_id=committed.pk, reason="fixed itself")
        _dispatch_b(results)

    fired = _stall_at(monkeypatch, "before_send", world)
    row_a, outcome_a = _run_a()
    assert fired == ["before_send"]
    assert results["b"] == "cancelled"
    assert outcome_a == "lost_lease"

    action = Action.objects.get(task=committed)
    assert refadmin.effects(action.idempotency_key) == 0
    assert refadmin.tickets() == []
    assert action.status == ActionStatus.NOT_SENT
    attempt_a = action.attempts.get(number=1)
    assert attempt_a.fencing_token == row_a.lease_generation
    assert attempt_a.outcome == AttemptOutcome.FAILED
    assert attempt_a.error["status"] == 409  # the remote refused A's old token
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.CANCELLED and task.state["receipt"] is None
    failed = TaskEvent.objects.get(task=task, type="dispatch.failed")
    assert failed.payload["executed"] is False
    assert task.budget_reserved == 0


def test_stalled_dispatcher_cannot_send_on_an_invalidated_approval(committed, device, refadmin, monkeypatch):
    """F2: A stalls before sending; the device changes, so B invalidates the approval and closes
    the row. A's late request is refused; the task asks for a new approval."""
    results = {}

    def world():
        _expire_lease(OutboxMessage.objects.get(action__task=committed).pk)
        device_update_state(device=device, alert_message="Fuser temperature low: 120 C")
        _dispatch_b(results)

    _stall_at(monkeypatch, "before_send", world)
    _, outcome_a = _run_a()
    assert (results["b"], outcome_a) == ("invalidated", "lost_lease")
    action = Action.objects.get(task=committed)
    assert refadmin.effects(action.idempotency_key) == 0
    assert action.status == ActionStatus.NOT_SENT
    task = drive(committed.pk)
    assert task.status == reducer.WAITING_APPROVAL
    approvals = list(ApprovalRequest.objects.filter(task=task).order_by("created_at"))
    assert [a.status for a in approvals] == [ApprovalStatus.INVALIDATED, ApprovalStatus.PENDING]
    assert refadmin.tickets() == []


def test_crashed_dispatcher_whose_ticket_exists_is_not_recorded_as_not_executed(committed, requester, refadmin,
                                                                                 monkeypatch, client):
    """F3: A's request created the ticket, then A died before recording anything; the task is
    cancelled. B must not record "not executed": it fences, finds the ticket and records it as
    the receipt of a cancelled task (a late effect, shown, not undone)."""
    def die():
        raise Killed

    _stall_at(monkeypatch, "after_send", die)
    with pytest.raises(Killed):
        _run_a()
    action = Action.objects.get(task=committed)
    assert refadmin.effects(action.idempotency_key) == 1
    assert action.attempts.get().outcome == AttemptOutcome.IN_FLIGHT

    task_cancel(principal=p(requester), task_id=committed.pk, reason="changed my mind")
    # The requester's page says the outcome is being confirmed, and keeps polling for it.
    client.force_login(requester)
    page = client.get(reverse("task-detail", args=[committed.pk])).content.decode()
    assert "we are confirming with the ticket system whether it was created" in page
    assert 'hx-trigger="every 2s"' in page
    _expire_lease(OutboxMessage.objects.get(action=action).pk)
    results = {}
    _dispatch_b(results)
    assert results["b"] == "receipt"
    page = client.get(reverse("task-detail", args=[committed.pk])).content.decode()
    assert "cancelled after this ticket was created" in page and 'hx-trigger="every 2s"' not in page

    action.refresh_from_db()
    assert action.status == ActionStatus.SUCCEEDED
    [ticket] = refadmin.tickets()
    assert action.external_id == ticket["id"]
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.CANCELLED
    assert task.state["receipt"]["external_id"] == ticket["id"]
    assert not TaskEvent.objects.filter(task=task, type="dispatch.failed").exists()
    assert (task.budget_used, task.budget_reserved) == (5, 0)
    assert OutboxMessage.objects.get(action=action).status == OutboxStatus.DELIVERED


def test_reconciler_not_found_while_the_request_is_still_in_flight(committed, requester, refadmin, monkeypatch):
    """F3: A's request is still travelling when A gives up (unknown outcome). The reconciler finds
    nothing and re-queues; the task is cancelled; B fences and records "not executed". When A's
    request finally arrives it is refused: the record stays true."""
    late = {}
    real_create = ReferenceTicketConnector.create_ticket

    def lost_in_transit(self, **kwargs):
        late.update(kwargs)
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", lost_in_transit)
    _, outcome_a = _run_a()
    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", real_create)
    assert outcome_a == "unknown"
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.UNKNOWN
    assert Task.objects.get(pk=committed.pk).status == reducer.WAITING_RECONCILIATION

    unknown_outcomes.actions_reconcile()  # nothing found by key: the same row is re-queued
    assert OutboxMessage.objects.get(action=action).status == OutboxStatus.PENDING
    task_cancel(principal=p(requester), task_id=committed.pk, reason="no longer needed")
    results = {}
    _dispatch_b(results)
    assert results["b"] == "cancelled"
    assert Action.objects.get(pk=action.pk).status == ActionStatus.NOT_SENT

    with pytest.raises(errors.PreconditionFailed) as refused:
        real_create(ReferenceTicketConnector(), **late)  # A's request arrives at last
    assert refused.value.body == {"error": "stale_fencing_token", "highest": results["b_token"]}
    assert refadmin.effects(action.idempotency_key) == 0
    assert Task.objects.get(pk=committed.pk).status == reducer.CANCELLED


def test_reconciler_retry_and_a_late_original_request_make_one_ticket(committed, refadmin, monkeypatch):
    """The same race without the cancel: B re-sends with the same key and a higher token, A's late
    request is refused, and the remote holds exactly one ticket."""
    late = {}
    real_create = ReferenceTicketConnector.create_ticket

    def lost_in_transit(self, **kwargs):
        late.update(kwargs)
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", lost_in_transit)
    _run_a()
    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", real_create)
    task = drive(committed.pk)
    assert task.status == reducer.COMPLETED
    with pytest.raises(errors.PreconditionFailed):
        real_create(ReferenceTicketConnector(), **late)
    action = Action.objects.get(task=task)
    assert refadmin.effects(action.idempotency_key) == 1
    assert [a.outcome for a in action.attempts.order_by("number")] == [AttemptOutcome.UNKNOWN,
                                                                         AttemptOutcome.RECEIPT]


def test_definite_failure_after_an_unanswered_attempt_adopts_the_ticket(committed, refadmin, monkeypatch):
    """A's request created the ticket but its answer was lost (attempt UNKNOWN, then re-queued by
    hand as the reconciler would); B's own request then fails definitely (422). B must not record
    "not executed": the fence finds A's ticket and it becomes the receipt."""
    refadmin.fault("drop_after_commit")
    _, outcome_a = _run_a()
    assert outcome_a == "unknown"
    action = Action.objects.get(task=committed)
    Action.objects.filter(pk=action.pk).update(status=ActionStatus.INTENDED)
    OutboxMessage.objects.filter(action=action).update(status=OutboxStatus.PENDING, available_at=action.created_at)
    task_append_with_retry(task_id=committed.pk, event_type="reconciliation.retry", actor="test",
                           payload_fn=lambda t: {"action_id": str(action.pk), "reason": "not found by key"})

    def rejected(self, **kwargs):
        raise errors.InvalidParams("HTTP 422: idempotency_key_reused", status=422)

    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", rejected)
    results = {}
    _dispatch_b(results)
    assert results["b"] == "receipt"
    action.refresh_from_db()
    assert action.status == ActionStatus.SUCCEEDED
    assert [a.outcome for a in action.attempts.order_by("number")] == [AttemptOutcome.UNKNOWN,
                                                                         AttemptOutcome.FAILED]
    assert not TaskEvent.objects.filter(task=committed, type="dispatch.failed").exists()
    assert refadmin.effects(action.idempotency_key) == 1


def test_remote_unreachable_for_the_fence_decides_nothing(committed, requester, refservice, monkeypatch):
    """When the fence cannot reach the remote, nothing is recorded as not executed: the row goes
    back to PENDING with backoff and the next claim asks again."""
    def die():
        raise Killed

    _stall_at(monkeypatch, "before_send", die)
    with pytest.raises(Killed):
        _run_a()  # A wrote its attempt and died: it may or may not have sent
    task_cancel(principal=p(requester), task_id=committed.pk)
    message = OutboxMessage.objects.get(action__task=committed)
    _expire_lease(message.pk)

    def unreachable(self, **kwargs):
        raise errors.DefinitelyNotExecuted("fence not delivered: ConnectError")

    monkeypatch.setattr(ReferenceTicketConnector, "fence", unreachable)
    results = {}
    _dispatch_b(results)
    assert results["b"] == "undecided"
    message.refresh_from_db()
    assert message.status == OutboxStatus.PENDING and message.available_at > message.created_at
    assert message.last_error["while"] == "fencing before recording not executed"
    assert Action.objects.get(task=committed).status == ActionStatus.INTENDED
    assert not TaskEvent.objects.filter(task=committed, type="dispatch.failed").exists()

    monkeypatch.undo()
    OutboxMessage.objects.filter(pk=message.pk).update(available_at=message.created_at)
    _dispatch_b(results)
    assert results["b"] == "cancelled"
    assert Action.objects.get(task=committed).status == ActionStatus.NOT_SENT


def test_a_refused_outcome_is_recorded_and_the_row_still_closes(committed, requester, device, monkeypatch):
    """F4: the task is cancelled between the dispatcher's cancel check and its invalidation event;
    δ refuses ``approval.invalidated`` in CANCELLED. The refusal is recorded, and the action and
    outbox rows still record that nothing was sent, so the row is not re-sent forever."""
    device_update_state(device=device, alert_message="Fuser temperature low: 120 C")
    real_invalidate = outbox.approval_invalidate

    def cancel_first(**kwargs):
        task_cancel(principal=p(requester), task_id=committed.pk, reason="raced")
        return real_invalidate(**kwargs)

    monkeypatch.setattr(outbox, "approval_invalidate", cancel_first)
    row, outcome = _run_a()
    assert outcome == "invalidated"
    refused = RefusedEvent.objects.get(task=committed, type="approval.invalidated")
    assert refused.reason == "task is terminal"
    message = OutboxMessage.objects.get(pk=row.pk)
    assert message.status == OutboxStatus.FAILED and message.lease_owner is None
    assert Action.objects.get(task=committed).status == ActionStatus.NOT_SENT
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.CANCELLED
    # The reservation is released by the "not executed" record the cancelled task does accept.
    failed = TaskEvent.objects.get(task=task, type="dispatch.failed")
    assert failed.payload["executed"] is False and task.budget_reserved == 0
    assert ActionAttempt.objects.filter(action__task=committed).count() == 0


def _unknown(monkeypatch):
    """Dispatcher A sends and gets no answer (the request never arrived): the action is UNKNOWN."""
    def lost_in_transit(self, **kwargs):
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ReferenceTicketConnector, "create_ticket", lost_in_transit)
        assert _run_a()[1] == "unknown"


def test_reconciler_settles_a_cancelled_tasks_unknown_action_without_sending(committed, requester, refadmin,
                                                                              monkeypatch):
    """Review 3 finding 1: the reconciler finds nothing for a cancelled task's unknown action. It
    must not re-queue a send (δ would refuse the retry and leave the rows disagreeing with the
    state): it fences the key and records "not executed"."""
    _unknown(monkeypatch)
    task_cancel(principal=p(requester), task_id=committed.pk, reason="no longer needed")
    unknown_outcomes.actions_reconcile()
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.NOT_SENT
    assert OutboxMessage.objects.get(action=action).status == OutboxStatus.FAILED
    failed = TaskEvent.objects.get(task=committed, type="dispatch.failed")
    assert failed.payload["executed"] is False and failed.payload["error"] == "not sent again: cancelled"
    assert not RefusedEvent.objects.filter(task=committed).exists()
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.CANCELLED and task.budget_reserved == 0
    assert refadmin.effects(action.idempotency_key) == 0
    assert [a.outcome for a in action.attempts.all()] == [AttemptOutcome.UNKNOWN]


def test_unknown_loop_ends_at_the_deadline_with_an_explicit_decision(committed, refadmin, monkeypatch):
    """Review 3 finding 3: a remote that never answers must not be sent to for ever. Past the
    deadline the reconciler settles the action (fence + lookup) and the task fails with a reason."""
    from datetime import timedelta

    from django.utils import timezone

    def hung(self, **kwargs):
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", hung)
    outbox.outbox_dispatch_batch()
    Task.objects.filter(pk=committed.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    for _ in range(10):
        outbox.outbox_dispatch_batch()
        unknown_outcomes.actions_reconcile()
    assert ActionAttempt.objects.filter(action__task=committed).count() == 1
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.FAILED
    assert task.termination_reason == "dispatch_failed: not sent again: deadline passed"
    assert Action.objects.get(task=committed).status == ActionStatus.NOT_SENT


def test_unknown_loop_ends_after_the_attempts_are_used(committed, monkeypatch):
    def hung(self, **kwargs):
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", hung)
    for _ in range(settlement.MAX_ATTEMPTS + 5):
        outbox.outbox_dispatch_batch()
        unknown_outcomes.actions_reconcile()
    assert ActionAttempt.objects.filter(action__task=committed).count() == settlement.MAX_ATTEMPTS
    retries = TaskEvent.objects.filter(task=committed, type="reconciliation.retry")
    assert retries.count() == settlement.MAX_ATTEMPTS - 1
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.FAILED
    assert task.termination_reason == f"dispatch_failed: not sent again: {settlement.MAX_ATTEMPTS} attempts used"


def test_a_dispatcher_whose_action_got_its_receipt_elsewhere_closes_its_attempt(committed, monkeypatch):
    """Review 3 finding 6: no attempt stays IN_FLIGHT once the action is settled."""
    real = ReferenceTicketConnector.create_ticket

    def created_then_lost(self, **kwargs):
        receipt = real(self, **kwargs)
        outbox.receipt_record(action_id=Action.objects.get(task=committed).pk, receipt=receipt, actor="other")
        raise errors.OutcomeUnknown("sent, no answer")

    monkeypatch.setattr(ReferenceTicketConnector, "create_ticket", created_then_lost)
    assert _run_a()[1] == "already_done"
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.SUCCEEDED
    assert [a.outcome for a in action.attempts.all()] == [AttemptOutcome.UNKNOWN]


def test_controller_invalidation_refused_by_a_lost_lease_is_recorded(committed, requester, approver, device, kb):
    """Review 3 finding 2: a worker whose lease passed on finds a changed premise; its
    ``approval.invalidated`` is refused and the refusal is recorded, and the approval row is left
    as it was."""
    from django.db.models import F

    from apps.agent.authorization import resume_after_approval as _resume_after_approval
    from apps.tasks.leases import task_claim
    from apps.tasks.store import StaleWrite

    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    task = drive(task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    device_update_state(device=device, alert_message="Fuser temperature low: 120 C")
    lease = task_claim(task_id=task.pk)
    Task.objects.filter(pk=task.pk).update(lease_generation=F("lease_generation") + 1)  # another worker took it
    stale = Task.objects.select_related("device", "tenant", "requester").get(pk=task.pk)
    with pytest.raises(StaleWrite):
        _resume_after_approval(stale, lease)
    refused = RefusedEvent.objects.get(task=task, type="approval.invalidated")
    assert "lease lost" in refused.reason
    assert ApprovalRequest.objects.get(pk=approval.pk).status == ApprovalStatus.APPROVED
