"""One test per row of the recovery table (DESIGN.md §6; spec table 16.5), with real processes: web,
a Celery worker, beat, the reference ticket service — and django-helpdesk behind the fault proxy for
the "response lost" row. Each kills a real worker at the named point (a failpoint SIGKILLs it) or
injects the named remote fault, and asserts the remote's effect count for the action — 0 while
nothing was sent, exactly 1 at the end — and the task's final state.

| row | crash point                         | how it is produced                                      |
|-----|-------------------------------------|---------------------------------------------------------|
| 1   | before the intent transaction commits | SIGKILL at ``before_commit:intent.committed``         |
| 2   | after commit, before send           | SIGKILL at ``before_send`` (attempt written, not sent)  |
| 3   | remote done, response lost          | ``drop_after_commit`` at the reference service / proxy  |
| 4   | receipt recorded, before the answer | SIGKILL at ``after_commit:receipt.recorded``            |
| 5   | approved, then the object changed   | the device changes between approval and resume          |
| 6   | cancelled, then a receipt arrives   | cancel while the remote delays the in-flight create     |
"""

from __future__ import annotations

import time

import httpx
import pytest

from apps.actions.models import Action, ActionAttempt
from apps.approvals.models import ApprovalRequest
from apps.devices.models import Device
from apps.devices.services import device_update_state
from apps.events.models import TaskEvent
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from tests.procs import HELPDESK_TOKEN, running_stack
from tests.test_crash_recovery import FAST, _file, _wait_for
from tests.test_e2e import poll, ref_client, seed_acme

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def stack(transactional_db, tmp_path):
    with running_stack(tmp_path, **FAST) as s:
        yield s


def _effects(stack, key: str, connector: str = "reference") -> int:
    """How many tickets the ticket system holds for ``key``."""
    if connector == "reference":
        return ref_client(stack).get("/_admin/effects", params={"idempotency_key": key}).json()["effects"]
    resp = httpx.get(f"{stack.proxy}/helpdesk/api/faultdesk/tickets/by-custom-field/",
                     params={"field": "faultdesk_key", "value": key},
                     headers={"Authorization": f"Token {HELPDESK_TOKEN}"}, timeout=10)
    return resp.json()["count"]


def _remote_total(stack) -> int:
    return len(ref_client(stack).get("/_admin/tickets").json()["results"])


def _finished(stack, task_id, statuses=("COMPLETED", "FAILED", "CANCELLED")) -> Task:
    riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
    poll(riley, task_id, set(statuses), 150, stack)
    task = Task.objects.get(pk=task_id)
    result = task_replay(task)
    assert result.ok, result.detail
    return task


def _doomed_worker(stack, tmp_path, point: str):
    fired = tmp_path / "failpoint-fired"
    stack.start_worker("doomed", pool="solo", FAULTDESK_FAILPOINT=point, FAULTDESK_FAILPOINT_ONCE=str(fired))
    return fired


def test_row1_crash_before_the_intent_commits(stack, tmp_path):
    seed_acme(auto_approve=True)
    fired = _doomed_worker(stack, tmp_path, "before_commit:intent.committed")
    task_id = _file(stack, Device.objects.get())
    _wait_for(fired, 120, stack)
    assert stack.wait_exit("doomed", 30) == -9
    assert not Action.objects.filter(task_id=task_id).exists(), "no action exists"
    assert _remote_total(stack) == 0, "nothing was sent"
    stack.start_worker("survivor")
    task = _finished(stack, task_id)
    assert task.status == "COMPLETED"
    assert _effects(stack, Action.objects.get(task=task).idempotency_key) == 1


def test_row2_crash_after_commit_before_send(stack, tmp_path):
    seed_acme(auto_approve=True)
    fired = _doomed_worker(stack, tmp_path, "before_send")
    task_id = _file(stack, Device.objects.get())
    _wait_for(fired, 120, stack)
    assert stack.wait_exit("doomed", 30) == -9
    action = Action.objects.get(task_id=task_id)
    assert [a.outcome for a in action.attempts.all()] == ["IN_FLIGHT"], "the attempt was written before sending"
    assert _effects(stack, action.idempotency_key) == 0
    stack.start_worker("survivor")
    task = _finished(stack, task_id)
    assert task.status == "COMPLETED"
    assert _effects(stack, action.idempotency_key) == 1
    # The dead dispatcher's attempt is closed; the delivered one holds the receipt.
    assert [a.outcome for a in action.attempts.order_by("number")] == ["UNKNOWN", "RECEIPT"]


@pytest.mark.parametrize("connector", ["reference", "helpdesk"])
def test_row3_remote_done_response_lost(stack, connector):
    tenant, _, device = seed_acme(auto_approve=True)
    if connector == "helpdesk":
        stack.start_helpdesk()
        tenant.ticket_system = "helpdesk"
        tenant.save(update_fields=["ticket_system"])
        httpx.post(f"{stack.proxy}/_proxy/faults", json={"mode": "drop_after_commit"}).raise_for_status()
    else:
        ref_client(stack).post("/_admin/faults", json={"mode": "drop_after_commit"}).raise_for_status()
    stack.start_worker("worker")
    task_id = _file(stack, device)
    task = _finished(stack, task_id)
    assert task.status == "COMPLETED", stack.logs()
    action = Action.objects.get(task=task)
    assert action.connector == connector
    assert [a.outcome for a in action.attempts.all()] == ["UNKNOWN"], "one request, its answer lost"
    assert TaskEvent.objects.filter(task=task, type="outcome.unknown").count() == 1
    assert TaskEvent.objects.get(task=task, type="receipt.recorded").actor == "reconciler"
    assert _effects(stack, action.idempotency_key, connector) == 1


def test_row4_crash_after_the_receipt_before_the_answer(stack, tmp_path):
    seed_acme(auto_approve=True)
    fired = _doomed_worker(stack, tmp_path, "after_commit:receipt.recorded")
    task_id = _file(stack, Device.objects.get())
    _wait_for(fired, 120, stack)
    assert stack.wait_exit("doomed", 30) == -9
    assert Task.objects.get(pk=task_id).state["receipt"] is not None
    stack.start_worker("survivor")
    task = _finished(stack, task_id)
    assert task.status == "COMPLETED"
    assert task.state["answer"]["change"]["ticket_id"] == task.state["receipt"]["external_id"]
    action = Action.objects.get(task=task)
    assert [a.outcome for a in action.attempts.all()] == ["RECEIPT"], "never re-executed"
    assert _effects(stack, action.idempotency_key) == 1


def test_row5_approved_then_the_object_changed(stack):
    _, _, device = seed_acme()
    riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
    avery = httpx.Client(base_url=stack.web, auth=("avery", "pw-for-tests"), timeout=30)
    stack.start_worker("worker")
    task_id = _file(stack, device)
    poll(riley, task_id, {"WAITING_APPROVAL"}, 120, stack)
    stack.stop("worker")  # nothing resumes the task until the object has changed
    [pending] = avery.get("/api/approvals/", params={"status": "PENDING", "task": task_id}).json()
    assert avery.post(f"/api/approvals/{pending['id']}/decision/", json={"decision": "approve"}).status_code == 200
    device_update_state(device=Device.objects.get(pk=device.pk), alert_message="Fuser temperature low: 120 C")
    stack.start_worker("worker-2")
    deadline = time.monotonic() + 120
    while ApprovalRequest.objects.filter(task_id=task_id, status="PENDING").count() == 0:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.3)
    approvals = list(ApprovalRequest.objects.filter(task_id=task_id).order_by("created_at"))
    assert [a.status for a in approvals] == ["INVALIDATED", "PENDING"]
    assert approvals[1].object_version == approvals[0].object_version + 1
    assert _remote_total(stack) == 0, "nothing is sent on a stale approval"
    assert avery.post(f"/api/approvals/{approvals[1].pk}/decision/", json={"decision": "approve"}).status_code == 200
    task = _finished(stack, task_id)
    assert task.status == "COMPLETED"
    assert _effects(stack, Action.objects.get(task=task).idempotency_key) == 1
    assert _remote_total(stack) == 1


def _cancel_while_in_flight(stack, delay_seconds: float):
    """File a task, delay the remote's processing of its create, and cancel while it is in flight."""
    _, _, device = seed_acme(auto_approve=True)
    ref_client(stack).post("/_admin/faults", json={"mode": "delay", "delay_seconds": delay_seconds}).raise_for_status()
    riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
    stack.start_worker("worker")
    task_id = _file(stack, device)
    deadline = time.monotonic() + 120
    while not ActionAttempt.objects.filter(action__task_id=task_id).exists():  # the create is in flight
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    resp = riley.post(f"/api/tasks/{task_id}/cancel/", json={"reason": "fixed itself"})
    assert resp.status_code == 200, resp.text
    return riley, task_id


def test_row6_cancelled_then_a_receipt_arrives(tmp_path, transactional_db):
    """The in-flight create takes effect after the cancel (the remote's delay is shorter than the
    outbox lease): the real effect is recorded on the cancelled task, and closing the ticket is
    only done once authorized — a compensation with its own approval (ADR 0011)."""
    with running_stack(tmp_path, **{**FAST, "FAULTDESK_OUTBOX_LEASE_SECONDS": "20"}) as stack:
        riley, task_id = _cancel_while_in_flight(stack, 3.0)
        deadline = time.monotonic() + 60
        while not TaskEvent.objects.filter(task_id=task_id, type="receipt.recorded").exists():
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.2)
        task = _finished(stack, task_id, statuses=("COMPENSATING",))
        assert task.state["receipt"]["external_id"], "the real effect is recorded on the cancelled task"
        assert not TaskEvent.objects.filter(task=task, type="task.completed").exists()
        body = riley.get(f"/api/tasks/{task_id}/").json()
        assert body["status"] == "COMPENSATING" and "compensation" in body["waiting_for"]
        assert body["receipt"]["external_id"] == task.state["receipt"]["external_id"]
        original = Action.objects.get(task=task)
        assert _effects(stack, original.idempotency_key) == 1
        # Nothing is closed until an approver authorizes it.
        avery = httpx.Client(base_url=stack.web, auth=("avery", "pw-for-tests"), timeout=30)
        [pending] = avery.get("/api/approvals/", params={"status": "PENDING", "task": str(task_id)}).json()
        assert pending["tool"] == "ticket.update" and pending["params"]["changes"]["status"] == "closed"
        ticket = ref_client(stack).get(f"/tickets/{task.state['receipt']['external_id']}").json()
        assert ticket["status"] == "open"
        assert avery.post(f"/api/approvals/{pending['id']}/decision/", json={"decision": "approve"}).status_code == 200
        task = _finished(stack, task_id, statuses=("CANCELLED",))
        assert task.state["compensation"]["status"] == "DONE"
        ticket = ref_client(stack).get(f"/tickets/{task.state['receipt']['external_id']}").json()
        assert ticket["status"] == "closed"
        assert _effects(stack, original.idempotency_key) == 1


def test_row6_cancelled_while_a_slow_create_outlives_its_lease(stack):
    """The remote is still holding the create when the dispatcher's lease expires (3 s < 6 s):
    another dispatcher sees the cancel, fences the key and records "not executed"; the late
    create is then refused by the remote. Nothing is created, and the record says so truly."""
    _, task_id = _cancel_while_in_flight(stack, 6.0)
    deadline = time.monotonic() + 60
    while not TaskEvent.objects.filter(task_id=task_id, type="dispatch.failed").exists():
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    task = _finished(stack, task_id)
    assert task.status == "CANCELLED" and task.state["receipt"] is None
    assert TaskEvent.objects.get(task=task, type="dispatch.failed").payload["executed"] is False
    action = Action.objects.get(task=task)
    deadline = time.monotonic() + 30
    while action.attempts.filter(outcome="IN_FLIGHT").exists():  # the slow request's answer comes back
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    assert "POST /tickets HTTP/1.1\" 409" in stack.log("refservice"), "the late create was refused"
    assert _effects(stack, action.idempotency_key) == 0
