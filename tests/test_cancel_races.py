"""Cancel races (DESIGN.md §8; ADR 0013; spec table 16.5 "取消后收到回执"): a cancel is an event first; it
stops new dispatch, signals the activity in flight, ignores results that lost their right to apply,
and keeps the receipt of an action that really happened. Each cancel here goes through the API or
the requester's page while the other side is really running (a thread calling the ticket service or
the model server over HTTP)."""

from __future__ import annotations

import threading
import time

import pytest

from apps.actions.models import Action, ActionStatus
from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.outbox.models import OutboxMessage
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p, settle_receipts

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _approved_and_committed(requester, approver, device) -> Task:
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    return Task.objects.get(pk=task.pk)


def _thread(fn, *args) -> threading.Thread:
    """Run ``fn(*args)`` in a thread that closes its database connection when done."""
    from django.db import connections

    def run() -> None:
        try:
            fn(*args)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait(cond, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_cancel_before_dispatch_sends_nothing(client, requester, approver, device, kb, refservice, refadmin):
    task = _approved_and_committed(requester, approver, device)
    action = Action.objects.get(task=task)
    assert OutboxMessage.objects.get(action=action).status == "PENDING"
    client.force_login(requester)
    answer = client.post(f"/api/tasks/{task.pk}/cancel/", {"reason": "fixed it myself"},
                         content_type="application/json")
    assert answer.status_code == 200 and answer.json()["status"] == reducer.CANCELLED
    outbox_dispatch_batch()
    task = drive(task.pk)
    assert refadmin.requests(action.idempotency_key) == 0, "nothing reached the ticket service"
    action.refresh_from_db()
    assert action.status == ActionStatus.NOT_SENT and task.status == reducer.CANCELLED
    assert task.state["receipt"] is None and task.budget_reserved == 0
    assert task.termination_reason == "cancelled: fixed it myself"


@pytest.mark.django_db(transaction=True)
def test_cancel_during_an_in_flight_dispatch_keeps_the_late_receipt_and_shows_the_ticket(
        client, requester, approver, device, kb, refservice, refadmin):
    task = _approved_and_committed(requester, approver, device)
    action = Action.objects.get(task=task)
    refadmin.fault("delay", delay_seconds=1.5)  # the ticket service takes its time to answer
    sender = _thread(outbox_dispatch_batch)
    _wait(lambda: refadmin.requests(action.idempotency_key) == 1)  # the request is in flight
    client.force_login(requester)
    page = client.post(f"/tasks/{task.pk}/cancel/", {"reason": "no longer needed"})
    assert page.status_code in (200, 302)
    assert Task.objects.get(pk=task.pk).status == reducer.CANCELLED
    sender.join(30)
    assert settle_receipts() == 1  # the agent worker's half of the dispatcher's receipt

    task = Task.objects.get(pk=task.pk)
    action.refresh_from_db()
    assert refadmin.effects(action.idempotency_key) == 1, "the ticket was really created, once"
    assert action.status == ActionStatus.SUCCEEDED and task.state["receipt"]["external_id"] == action.external_id
    types = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))
    assert types.index("cancel.requested") < types.index("receipt.recorded"), "the receipt arrived after the cancel"
    assert task.status == reducer.CANCELLED
    # the requester sees that the cancelled request still created a ticket, and which
    api = client.get(f"/api/tasks/{task.pk}/").json()
    assert api["status"] == reducer.CANCELLED and api["receipt"]["external_id"] == action.external_id
    assert action.external_id in client.get(f"/tasks/{task.pk}/").content.decode()
    # and nothing closes it without a person: the compensation waits for its own approval
    drive(task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.COMPENSATING and task.state["compensation"]["status"] == "WAITING_APPROVAL"
    assert refadmin.effects(action.idempotency_key) == 1
    assert task.state["reservations"] == {} and task.budget_reserved == 0


@pytest.mark.django_db(transaction=True)
def test_cancel_during_a_model_call_abandons_it_and_takes_no_further_step(
        client, requester, device, kb, refservice, model_server):
    model_server.set_script([{"reply": "draft", "delay_seconds": 4.0}])
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    worker = _thread(drive, task.pk)
    _wait(lambda: len(model_server.requests) == 1)  # the model call is in flight
    client.force_login(requester)
    answer = client.post(f"/api/tasks/{task.pk}/cancel/", {}, content_type="application/json")
    assert answer.status_code == 200
    worker.join(30)
    drive(task.pk)  # and any later step finds nothing to do

    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.CANCELLED
    types = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))
    assert types[-2:] == ["cancel.requested", "model.called"], types
    call = TaskEvent.objects.get(task=task, type="model.called").payload
    assert call["outcome"] == "cancelled" and call["usage"] is None
    # the abandoned call may still be billed: charged at its reservation, then nothing reserved
    reserved = TaskEvent.objects.get(task=task, type="budget.reserved", payload__activity="model_call").payload
    assert call["used"]["tokens"] == reserved["amounts"]["tokens"]
    assert task.state["reservations"] == {} and task.budget_reserved == 0
    assert task.budget_used == reserved["amounts"]["money"]
    for etype in ("draft.proposed", "approval.requested", "intent.committed"):
        assert etype not in types
    assert not ApprovalRequest.objects.filter(task=task).exists() and not Action.objects.filter(task=task).exists()
    assert len(model_server.requests) == 1, "no further model call"


def test_a_cancel_while_waiting_for_approval_shows_the_approval_closed_everywhere(client, requester, device, kb,
                                                                                 refservice):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    client.force_login(requester)
    body = client.post(f"/api/tasks/{task.pk}/cancel/", {}, content_type="application/json").json()
    assert body["status"] == reducer.CANCELLED
    assert body["approval"]["status"] == "INVALIDATED" and body["approval"]["reason"] == "the task was cancelled"
    assert ApprovalRequest.objects.get(task=task).status == ApprovalStatus.INVALIDATED
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    assert 'Approval: <span class="status">Invalidated</span> — the task was cancelled' in page
    assert 'Approval: <span class="status">Pending</span>' not in page


def test_the_request_page_names_what_the_task_is_doing_now(client, requester, device, kb, refservice):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    client.force_login(requester)
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    assert "<strong>Now:</strong> Queued: the agent starts in a moment." in page
    drive(task.pk)
    fragment = client.get(f"/tasks/{task.pk}/", HTTP_HX_REQUEST="true")
    assert "Waiting for an approver to review the proposal." in fragment.content.decode()
    assert "<html" not in fragment.content.decode() and "HX-Request" in fragment["Vary"]
