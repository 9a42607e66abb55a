"""django-helpdesk 2.6 as the second ticket system (DESIGN.md §11; ADR 0010): a real helpdesk
project in its own process (gunicorn) and its own SQLite database, reached only over its REST API —
through the fault-injecting proxy, so a response can be lost after helpdesk committed.

helpdesk has no idempotency support: the connector writes the action key into the custom field
``faultdesk_key`` and looks it up before any resend."""

from __future__ import annotations

import time
from datetime import datetime

import httpx
import pytest

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.core import tool_errors as errors
from apps.events.models import TaskEvent
from apps.outbox import dispatch as outbox
from apps.outbox import unknown_outcomes
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_submit
from apps.tickets.connectors import HelpdeskConnector
from tests.conftest import drive, p
from tests.procs import helpdesk_running
from tools import faultproxy

TOKEN = "helpdesktesttoken0000000000000000000000"[:40].ljust(40, "0")
SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.fixture(scope="module")
def helpdesk_server(tmp_path_factory):
    """A real django-helpdesk (gunicorn, own SQLite) for this module, and a fault proxy before it."""
    with helpdesk_running(tmp_path_factory.mktemp("helpdesk"), TOKEN) as base:
        proxy = faultproxy.serve_in_thread(0, base, fault_prefix="/helpdesk/api/tickets/")
        yield proxy
        proxy.shutdown()
        proxy.server_close()


@pytest.fixture
def hd(helpdesk_server, settings, tenant):
    """This test's settings point at the helpdesk (through the proxy); the tenant files there."""
    settings.FAULTDESK = {**settings.FAULTDESK, "HELPDESK_URL": helpdesk_server.url, "HELPDESK_API_TOKEN": TOKEN,
                          "HELPDESK_REQUEST_LIFETIME_SECONDS": 1.0}
    tenant.ticket_system = "helpdesk"
    tenant.save(update_fields=["ticket_system"])
    httpx.post(f"{helpdesk_server.url}/_proxy/faults", json={"mode": "none"})
    return helpdesk_server


def _fault(proxy, mode, **kw):
    assert httpx.post(f"{proxy.url}/_proxy/faults", json={"mode": mode, **kw}).status_code == 200


def _tickets_for(key: str) -> list[dict]:
    resp = httpx.get(f"{HelpdeskConnector().base_url}/helpdesk/api/faultdesk/tickets/by-custom-field/",
                     params={"field": "faultdesk_key", "value": key}, headers={"Authorization": f"Token {TOKEN}"})
    assert resp.status_code == 200, resp.text
    return resp.json()["results"]


@pytest.fixture
def committed(hd, requester, approver, device, kb):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    task = drive(task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    action = Action.objects.get(task=task)
    assert action.connector == "helpdesk"
    assert TaskEvent.objects.get(task=task, type="intent.committed").payload["connector"] == "helpdesk"
    return Task.objects.get(pk=task.pk)


def test_main_job_creates_one_helpdesk_ticket_with_the_key(committed):
    task = drive(committed.pk)
    assert task.status == reducer.COMPLETED
    action = Action.objects.get(task=task)
    [ticket] = _tickets_for(action.idempotency_key)
    assert str(ticket["id"]) == action.external_id == task.state["receipt"]["external_id"]
    assert task.state["receipt"]["connector"] == "helpdesk"
    assert ticket["title"] == action.params["title"]
    assert ticket["priority"] == {"P1": 1, "P2": 2, "P3": 3, "P4": 4}[action.params["priority"]]
    assert "PRN-0417" in ticket["description"]
    # the service levels' due date, approved with the parameters, is the helpdesk ticket's due date
    full = httpx.get(f"{HelpdeskConnector().base_url}/helpdesk/api/tickets/{ticket['id']}/",
                     headers={"Authorization": f"Token {TOKEN}"})
    assert full.status_code == 200, full.text
    assert action.params["due_at"] and datetime.fromisoformat(full.json()["due_date"].replace("Z", "+00:00")) == \
        datetime.fromisoformat(action.params["due_at"])


def test_response_lost_after_helpdesk_committed_is_adopted_by_reconciliation(committed, hd):
    """The same "response lost after the remote committed" test as for the reference service — one
    ticket, adopted by reconciliation."""
    _fault(hd, "drop_after_commit")
    outbox.outbox_dispatch_batch()
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.UNKNOWN
    assert Task.objects.get(pk=committed.pk).status == reducer.WAITING_RECONCILIATION
    [ticket] = _tickets_for(action.idempotency_key)  # helpdesk did create it
    unknown_outcomes.actions_reconcile()
    action.refresh_from_db()
    assert action.status == ActionStatus.SUCCEEDED and action.external_id == str(ticket["id"])
    assert TaskEvent.objects.get(task=committed, type="receipt.recorded").actor == "reconciler"
    task = drive(committed.pk)
    assert task.status == reducer.COMPLETED
    assert len(_tickets_for(action.idempotency_key)) == 1


def test_resend_after_an_unanswered_request_looks_the_key_up_first(committed, hd, monkeypatch):
    """The request is lost before helpdesk saw it. The reconciler finds nothing and re-queues;
    the dispatcher may resend only once the unanswered request can no longer take effect (its
    lifetime, 1 s here), and only after looking the key up again. One ticket."""
    def lost(self, **kwargs):
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HelpdeskConnector, "create_ticket", lost)
        outbox.outbox_dispatch_batch()
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.UNKNOWN
    unknown_outcomes.actions_reconcile()  # nothing found: re-queued with the same key
    assert outbox.outbox_dispatch_batch() == 1
    message = action.outbox
    message.refresh_from_db()
    assert message.status == "PENDING" and message.last_error["code"] == "not_yet_provable"
    assert ActionAttempt.objects.filter(action=action).count() == 1, "no resend inside the lifetime"
    time.sleep(1.1)
    from apps.outbox.models import OutboxMessage

    OutboxMessage.objects.filter(pk=message.pk).update(available_at=message.created_at)
    task = drive(committed.pk)
    assert task.status == reducer.COMPLETED
    assert [a.outcome for a in action.attempts.order_by("number")] == [AttemptOutcome.UNKNOWN,
                                                                         AttemptOutcome.RECEIPT]
    assert len(_tickets_for(action.idempotency_key)) == 1


def test_a_second_create_with_the_same_key_returns_the_first_ticket(hd):
    connector = HelpdeskConnector()
    params = {"title": "Fuser error on PRN-0417", "description": "Smeared pages after warm-up.", "priority": "P3",
              "device": "PRN-0417", "tenant": "acme", "requester": "riley", "labels": [], "evidence": ["kb/x"]}
    first = connector.create_ticket(idempotency_key="hd-dup-key", fencing_token=1, params=params)
    second = connector.create_ticket(idempotency_key="hd-dup-key", fencing_token=2, params=params)
    assert (first.replayed, second.replayed) == (False, True)
    assert first.external_id == second.external_id
    assert len(_tickets_for("hd-dup-key")) == 1
    assert connector.get_ticket(external_id=first.external_id)["idempotency_key"] == "hd-dup-key"
    assert connector.get_ticket(external_id="999999") is None


def test_cancel_with_an_unanswered_request_waits_then_records_not_executed(committed, hd, requester, monkeypatch):
    """helpdesk cannot fence a key: "not executed" is recorded only after the unanswered request's
    lifetime, and after a lookup."""
    def lost(self, **kwargs):
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HelpdeskConnector, "create_ticket", lost)
        outbox.outbox_dispatch_batch()
    task_cancel(principal=p(requester), task_id=committed.pk, reason="fixed itself")
    unknown_outcomes.actions_reconcile()  # cancelled: settle without resending, but not provable yet
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.UNKNOWN
    time.sleep(1.1)
    unknown_outcomes.actions_reconcile()
    action.refresh_from_db()
    assert action.status == ActionStatus.NOT_SENT
    assert _tickets_for(action.idempotency_key) == []
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.CANCELLED and task.budget_reserved == 0


def test_replay_remote_asks_each_actions_own_ticket_system(committed, refservice):
    """``replay --all --remote`` checks a helpdesk action at helpdesk, not at the reference service."""
    from io import StringIO

    from django.core.management import call_command

    drive(committed.pk)
    out = StringIO()
    call_command("replay", "--all", "--remote", stdout=out)
    assert "1 of 1 tasks have action records that agree with their state and the ticket system" in out.getvalue()


def test_executed_resolution_needs_a_ticket_carrying_the_actions_key(committed, hd, admin_user, monkeypatch):
    """A person may not name an unrelated helpdesk ticket (no key) as this action's effect; the
    right one is recorded with the helpdesk connector."""
    from apps.core.errors import Unprocessable
    from apps.outbox.reconciliation import reconciliation_resolve

    _fault(hd, "drop_after_commit")
    outbox.outbox_dispatch_batch()
    action = Action.objects.get(task=committed)
    [ours] = _tickets_for(action.idempotency_key)
    unrelated = httpx.post(f"{hd.url}/helpdesk/api/tickets/", headers={"Authorization": f"Token {TOKEN}"},
                           json={"queue": 1, "title": "Coffee machine leaking", "description": "kitchen",
                                 "priority": 3})
    assert unrelated.status_code == 201
    with pytest.raises(Unprocessable, match="was not created by this action"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=True,
                               external_id=str(unrelated.json()["id"]), note="this one")
    resolved = reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=True,
                                      external_id=str(ours["id"]), note="found it in helpdesk")
    assert resolved.status == ActionStatus.SUCCEEDED and resolved.receipt["connector"] == "helpdesk"
    assert resolved.ticket.connector == "helpdesk"


def test_a_second_report_files_a_new_ticket_and_a_compensation_goes_to_a_person(committed, requester, approver,
                                                                                device, admin_user):
    """django-helpdesk has no ticket version: no conditional comment (a new ticket per report), and
    closing a ticket after a cancel waits for a person at once (ADR 0011)."""
    from apps.tasks.compensation import compensation_settle

    first = drive(committed.pk)
    assert first.status == reducer.COMPLETED
    second = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert second.state["ticket"] is None
    approval = ApprovalRequest.objects.get(task=second, status=ApprovalStatus.PENDING)
    assert approval.tool == "ticket.create"
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    agent_run(task_id=second.pk)
    # Cancelled, then a receipt arrives: the ticket is created but its answer is lost, the
    # requester cancels, and the reconciler finds the ticket by its key after the request's lifetime.
    created = HelpdeskConnector.create_ticket

    def answer_lost(self, **kwargs):
        created(self, **kwargs)
        raise errors.OutcomeUnknown("created, the answer was lost")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HelpdeskConnector, "create_ticket", answer_lost)
        outbox.outbox_dispatch_batch()
    task_cancel(principal=p(requester), task_id=second.pk, reason="fixed itself")
    time.sleep(1.1)  # helpdesk cannot fence a key: a lookup is final only after the request's lifetime
    second = drive(second.pk)
    assert second.state["receipt"] is not None
    assert second.status == reducer.WAITING_COMPENSATION
    assert "django-helpdesk has no conditional update" in second.state["compensation"]["error"]
    assert not ApprovalRequest.objects.filter(task=second, tool="ticket.update").exists()
    second = compensation_settle(principal=p(admin_user), task_id=second.pk, decision="done_by_hand",
                                 note="closed in helpdesk")
    assert second.status == reducer.CANCELLED and "done by hand" in second.termination_reason


def test_a_reports_files_reach_the_helpdesk_ticket_once_even_when_sent_again(hd, requester, approver, device, kb):
    """django-helpdesk has no idempotency key: the file goes as a private follow-up titled with its
    SHA-256, and a second send (after a crash that lost the first answer) finds it first."""
    import hashlib

    from django.utils import timezone

    from apps.attachments.delivery import deliveries_drain
    from apps.attachments.models import AttachmentDelivery, DeliveryStatus
    from apps.attachments.services import attachments_check

    log = b"08:00:09 ERROR E-203 fuser temperature below threshold\n"
    files = attachments_check([("printer.log", log, "text/plain")])
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high",
                       attachments=files).task
    task = drive(task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    task = drive(task.pk)
    ticket_id = task.state["receipt"]["external_id"]
    assert deliveries_drain() == 1
    row = AttachmentDelivery.objects.get()
    assert row.status == DeliveryStatus.DELIVERED and row.connector == "helpdesk" and row.ticket_id == ticket_id

    def listed():
        resp = httpx.get(f"{HelpdeskConnector().base_url}/helpdesk/api/faultdesk/tickets/{ticket_id}/attachments/",
                         headers={"Authorization": f"Token {TOKEN}"})
        assert resp.status_code == 200, resp.text
        return resp.json()["results"]

    sha = hashlib.sha256(log).hexdigest()
    assert [(a["filename"], a["size"], a["title"]) for a in listed()] == [
        ("printer.log", len(log), f"faultdesk attachment sha256:{sha}")]
    AttachmentDelivery.objects.update(status=DeliveryStatus.IN_FLIGHT, lease_expires_at=timezone.now(),
                                      available_at=timezone.now())
    assert deliveries_drain() == 1
    assert len(listed()) == 1 and AttachmentDelivery.objects.get().status == DeliveryStatus.DELIVERED
