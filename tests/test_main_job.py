"""The main job in-process against a real reference ticket service on loopback (DESIGN.md §1):
happy path, replay, scopes, rejection, invalidation, unknown outcome + reconciliation, cancel,
fencing. Steps run through the same services the Celery tasks call."""

from __future__ import annotations

import pytest

from apps.actions.models import Action, ActionStatus
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.devices.services import device_update_state
from apps.events.models import RefusedEvent, TaskEvent
from apps.evidence.models import Chunk
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks import reducer
from apps.tasks.leases import task_claim
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_cancel, task_submit
from apps.tasks.store import StaleWrite, task_append_event
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.fixture
def submitted(requester, device, kb):
    return task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task


def _approve(approver, task):
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    return approval


def test_happy_path_ends_completed_with_one_receipt_and_replays(submitted, approver, refservice, refadmin):
    task = drive(submitted.pk)
    assert task.status == reducer.WAITING_APPROVAL
    approval = ApprovalRequest.objects.get(task=task)
    assert approval.object_version == 17
    assert approval.action_digest == task.state["proposal"]["digest"]
    assert not refadmin.tickets(), "nothing may be sent before the approval"

    _approve(approver, task)
    task = drive(task.pk)

    assert task.status == reducer.COMPLETED
    action = Action.objects.get(task=task)
    assert action.status == ActionStatus.SUCCEEDED
    assert task.state["receipt"]["external_id"] == action.external_id
    assert task.state["answer"]["change"]["ticket_id"] == action.external_id
    assert refadmin.effects(action.idempotency_key) == 1
    tickets = [t for t in refadmin.tickets() if t["idempotency_key"] == action.idempotency_key]
    assert len(tickets) == 1 and tickets[0]["id"] == action.external_id
    # Budget: reserved 5 at intent, settled at receipt.
    assert (task.budget_used, task.budget_reserved) == (5, 0)
    # The answer cites evidence by document, version and section.
    cites = task.state["answer"]["knowledge"]["citations"]
    assert cites and all({"document_title", "version", "section"} <= set(c) for c in cites)
    # Version == number of events; replay reproduces the row.
    assert task.version == TaskEvent.objects.filter(task=task).count()
    assert task_replay(task).ok
    assert task_replay(task, use_snapshot=False).ok
    types = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))
    # reducer/6: the plan, one reservation per read, then each read reports by its own event and settles its
    # own reservation — the device and retrieval in the dispatching run, the ticket read by its activity
    assert types == ["task.accepted", "retrieval.started", "plan.activated",
                     "budget.reserved", "budget.reserved", "budget.reserved",
                     "device.read", "evidence.retrieved", "ticket.read",
                     "budget.reserved", "model.called", "draft.proposed",
                     "approval.requested", "approval.granted", "intent.committed", "receipt.recorded",
                     "task.completed"]
    # The ledger (reducer/3): 3 tool reads + 1 write, the local drafter costs nothing, nothing left reserved.
    assert task.state["limits"]["tool_calls"] == {"total": 40, "used": 4, "reserved": 0}
    assert task.state["limits"]["tokens"]["used"] == 0 and task.state["reservations"] == {}


def test_evidence_is_limited_to_the_requesters_scopes(submitted, refservice):
    task = drive(submitted.pk)
    refs = task.state["evidence"]
    assert refs
    scopes = {c.scope for c in Chunk.objects.filter(pk__in=[r["chunk_id"] for r in refs])}
    assert scopes <= {"public", "tier2"}
    assert "security" not in {r["scope"] for r in refs}
    # Each ref points at a current chunk version of the requester's tenant.
    for ref in refs:
        chunk = Chunk.objects.select_related("document_version").get(pk=ref["chunk_id"])
        assert chunk.document_version.version == ref["version"]
        assert chunk.tenant_id == submitted.tenant_id


@pytest.mark.allow_divergence
def test_replay_detects_a_tampered_row(submitted, refservice):
    task = drive(submitted.pk)
    Task.objects.filter(pk=task.pk).update(status=reducer.FAILED)
    result = task_replay(Task.objects.get(pk=task.pk))
    assert not result.ok
    assert result.divergent_seq == task.version
    assert "status" in result.detail


def test_rejection_ends_without_a_ticket_and_is_not_reproposed(submitted, approver, refservice, refadmin):
    task = drive(submitted.pk)
    approval = ApprovalRequest.objects.get(task=task)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="reject", reason="wrong device")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    assert task.termination_reason == "proposal_rejected"
    assert task.state["receipt"] is None and task.state["answer"]["change"] is None
    assert ApprovalRequest.objects.filter(task=task).count() == 1, "the same digest is never proposed again"
    assert refadmin.tickets() == []
    assert task_replay(task).ok


def test_device_change_after_approval_invalidates_and_reasks(submitted, approver, device, refservice, refadmin):
    task = drive(submitted.pk)
    _approve(approver, task)
    device_update_state(device=device, alert_message="Fuser temperature low: 120 C")  # V_o 17 → 18
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    approvals = list(ApprovalRequest.objects.filter(task=task).order_by("created_at"))
    assert [a.status for a in approvals] == [ApprovalStatus.INVALIDATED, ApprovalStatus.PENDING]
    assert "device version changed" in approvals[0].closed_reason
    assert approvals[1].object_version == 18
    assert refadmin.tickets() == [], "no dispatch on a stale approval"
    _approve(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    assert Action.objects.get(task=task).object_version == 18


def test_lost_response_is_reconciled_by_key_without_a_second_ticket(submitted, approver, refservice, refadmin):
    from apps.agent.runner import agent_run
    from apps.outbox.dispatch import outbox_dispatch_batch

    task = drive(submitted.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)  # commits the intent
    refadmin.fault("drop_after_commit")
    outbox_dispatch_batch()  # the remote creates the ticket, the response is lost
    task = Task.objects.get(pk=task.pk)
    action = Action.objects.get(task=task)
    assert task.status == reducer.WAITING_RECONCILIATION
    assert action.status == ActionStatus.UNKNOWN
    assert task.state["answer"] is None, "never claim creation without a receipt"

    task = drive(task.pk)  # the reconciler looks the key up and adopts the ticket
    action.refresh_from_db()
    assert task.status == reducer.COMPLETED
    assert refadmin.effects(action.idempotency_key) == 1
    assert len(refadmin.tickets()) == 1
    assert task_replay(task).ok


def test_temporarily_unavailable_is_retried_with_the_same_key(submitted, approver, refservice, refadmin):
    from apps.agent.runner import agent_run
    from apps.outbox.dispatch import outbox_dispatch_batch

    task = drive(submitted.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)
    refadmin.fault("fail_503")
    outbox_dispatch_batch()
    message = OutboxMessage.objects.get(action__task=task)
    assert message.status == OutboxStatus.PENDING and message.attempts == 1
    OutboxMessage.objects.filter(pk=message.pk).update(available_at=message.created_at)  # skip the backoff
    task = drive(task.pk)
    action = Action.objects.get(task=task)
    assert task.status == reducer.COMPLETED
    assert [a.outcome for a in action.attempts.order_by("number")] == ["RETRYABLE", "RECEIPT"]
    assert refadmin.effects(action.idempotency_key) == 1


def test_cancel_before_dispatch_sends_nothing(submitted, approver, requester, refservice, refadmin):
    from apps.agent.runner import agent_run

    task = drive(submitted.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)  # intent + outbox row committed
    task_cancel(principal=p(requester), task_id=task.pk, reason="fixed itself")
    task = drive(task.pk)
    assert task.status == reducer.CANCELLED
    assert Action.objects.get(task=task).status == ActionStatus.NOT_SENT
    assert OutboxMessage.objects.get(action__task=task).status == OutboxStatus.CANCELLED
    assert refadmin.tickets() == []
    assert task.budget_reserved == 0
    assert task_replay(task).ok


def test_terminal_task_refuses_late_events_and_records_them(submitted, requester, refservice):
    task = task_cancel(principal=p(requester), task_id=submitted.pk)
    with pytest.raises(reducer.IllegalTransition):
        task_append_event(task=task, event_type="retrieval.started", payload={}, actor="worker:late")
    assert RefusedEvent.objects.filter(task=task, type="retrieval.started").exists()
    assert Task.objects.get(pk=task.pk).status == reducer.CANCELLED


def test_a_worker_whose_lease_passed_on_cannot_commit(submitted):
    first = task_claim(task_id=submitted.pk, owner="worker-a", seconds=1)
    task = Task.objects.get(pk=submitted.pk)
    Task.objects.filter(pk=task.pk).update(lease_expires_at=task.created_at)  # the lease expires
    second = task_claim(task_id=submitted.pk, owner="worker-b")
    assert second.generation == first.generation + 1
    with pytest.raises(StaleWrite):
        task_append_event(task=task, event_type="retrieval.started", payload={}, actor="worker-a",
                          lease_generation=first.generation)
    refused = RefusedEvent.objects.get(task=task, actor="worker-a")
    assert "lease lost" in refused.reason and refused.lease_generation == first.generation
    task_append_event(task=task, event_type="retrieval.started", payload={}, actor="worker-b",
                      lease_generation=second.generation)
    row = Task.objects.get(pk=task.pk)
    assert row.version == 2
    assert row.events.get(seq=2).actor == "worker-b"


def test_cas_loser_never_overwrites(submitted):
    a = Task.objects.get(pk=submitted.pk)
    b = Task.objects.get(pk=submitted.pk)
    task_append_event(task=a, event_type="retrieval.started", payload={}, actor="a")
    with pytest.raises(StaleWrite):
        task_append_event(task=b, event_type="cancel.requested", payload={}, actor="b")
    assert "version moved" in RefusedEvent.objects.get(task=submitted, actor="b").reason
    row = Task.objects.get(pk=submitted.pk)
    assert (row.status, row.version) == (reducer.RETRIEVING, 2)


def test_a_stale_dispatcher_records_nothing_after_another_recorded_the_receipt(submitted, approver, refservice):
    """Review finding F1: dispatcher A stalls, B re-claims the row and records the receipt; A's late
    error (409 stale fencing token) must not turn the task into an unknown outcome."""
    from apps.actions.models import ActionAttempt
    from apps.agent.runner import agent_run
    from apps.core import tool_errors as errors
    from apps.outbox.dispatch import outbox_claim_batch, outbox_deliver
    from apps.outbox.settlement import attempt_error_record

    task = drive(submitted.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)
    [row_a] = outbox_claim_batch(owner="A", limit=1)
    action = Action.objects.get(task=task)
    attempt_a = ActionAttempt.objects.create(action=action, number=1, fencing_token=row_a.lease_generation,
                                             started_at=row_a.created_at, worker="A")
    OutboxMessage.objects.filter(pk=row_a.pk).update(lease_expires_at=row_a.created_at)  # A's lease expires
    [row_b] = outbox_claim_batch(owner="B", limit=1)
    assert row_b.lease_generation == row_a.lease_generation + 1
    assert outbox_deliver(message_id=row_b.pk, fencing_token=row_b.lease_generation, owner="B") == "receipt"

    late = errors.PreconditionFailed("HTTP 409", status=409, body={"error": "stale_fencing_token"})
    outcome = attempt_error_record(row_a, action, attempt_a, Task.objects.get(pk=task.pk), late,
                                   row_a.lease_generation, "A")
    assert outcome == "lost_lease"
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    assert not TaskEvent.objects.filter(task=task, type="outcome.unknown").exists()
    assert Action.objects.get(pk=action.pk).status == ActionStatus.SUCCEEDED


def test_reconciler_carries_on_past_an_action_it_cannot_settle(submitted, approver, refservice, refadmin, monkeypatch):
    from apps.agent.runner import agent_run
    from apps.outbox import unknown_outcomes as outbox_services
    from apps.outbox.dispatch import outbox_dispatch_batch
    from apps.outbox.unknown_outcomes import actions_reconcile

    task = drive(submitted.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)
    refadmin.fault("drop_after_commit")
    outbox_dispatch_batch()
    assert Action.objects.get(task=task).status == ActionStatus.UNKNOWN
    calls = []
    real = outbox_services._reconcile_one

    def flaky(action):
        calls.append(action.pk)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(action)

    monkeypatch.setattr(outbox_services, "_reconcile_one", flaky)
    actions_reconcile()  # the failure is logged, not raised
    actions_reconcile()
    assert Action.objects.get(task=task).status == ActionStatus.SUCCEEDED
