"""Writes on an existing ticket and compensation, through the whole agent and outbox against the
real reference ticket service (reducer/2; ADR 0011).

* A second report for a device with an open faultdesk ticket becomes a comment on that ticket,
  conditional on the version the plan read (``If-Match``), under an approval bound to that ticket
  version — not a second ticket.
* A 412 (the ticket moved on) is ``dispatch.conflict``: nothing was written, the approval is
  invalidated, the task re-reads the ticket and re-plans (a new approval at the new version, or a
  new ticket when the old one was closed meanwhile).
* A cancelled task whose ticket was created anyway gets a compensation — closing the ticket — as a
  new action with its own approval; rejected, it leaves the ticket; when it fails it waits in
  ``WAITING_COMPENSATION`` until an admin retries it or records how it was settled.
"""

from __future__ import annotations

import pytest

from apps.actions.audit import task_actions_audit
from apps.actions.models import Action, ActionStatus
from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.core.errors import Conflict, Forbidden, NotFound
from apps.events.models import TaskEvent
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.tasks import reducer
from apps.tasks.compensation import compensation_settle, compensations_waiting
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_cancel, task_submit
from apps.tasks.store import task_append_event
from apps.tickets.connectors import ReferenceTicketConnector
from apps.tickets.models import TicketMirror
from tests.conftest import created_then_cancelled, drive, p, settle_receipts

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _types(task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))


def _pending(task) -> ApprovalRequest:
    return ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)


def _decide(approver, task, decision="approve", reason="ok") -> None:
    approval_decide(principal=p(approver), approval_id=_pending(task).pk, decision=decision, reason=reason)


def _submit(requester, device, symptom=SYMPTOM) -> Task:
    return task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=symptom).task


def _created(requester, approver, device) -> Task:
    """A first task that created the device's ticket (approved, COMPLETED)."""
    task = drive(_submit(requester, device).pk)
    _decide(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED and task.termination_reason == "ticket_created"
    return task


@pytest.fixture
def first(requester, approver, device, kb, refservice):
    return _created(requester, approver, device)


def test_a_second_report_comments_on_the_open_ticket_instead_of_a_duplicate(first, requester, approver, device,
                                                                            refadmin):
    ticket_id = first.state["receipt"]["external_id"]
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    assert task.status == reducer.WAITING_APPROVAL
    assert task.state["ticket"]["external_id"] == ticket_id and task.state["ticket"]["version"] == 1
    approval = _pending(task)
    assert (approval.tool, approval.object_type, approval.object_id, approval.object_version) == \
        ("ticket.comment", "ticket", ticket_id, 1)
    assert approval.params["if_match"] == 1 and "no new ticket" in approval.side_effects
    _decide(approver, task)
    task = drive(task.pk)

    assert task.status == reducer.COMPLETED and task.termination_reason == "ticket_commented"
    action = Action.objects.get(task=task)
    tickets = refadmin.tickets()
    assert len(tickets) == 1, "no second ticket"
    comments = tickets[0]["comments"]
    assert [c["idempotency_key"] for c in comments] == [action.idempotency_key]
    assert refadmin.effects(action.idempotency_key) == 1
    assert tickets[0]["version"] == 2
    change = task.state["answer"]["change"]
    assert (change["ticket_id"], change["comment_id"], change["ticket_version"]) == (ticket_id, comments[0]["id"], 2)
    assert "no second ticket" in task.state["answer"]["status_note"]
    assert TicketMirror.objects.get(external_id=ticket_id).external_version == 2
    assert task_actions_audit(task, remote=True) == []
    # reducer/6 reads the ticket and the device side by side: each once, both joined before the draft
    types = _types(task)
    assert types.count("ticket.read") == types.count("device.read") == 1
    assert max(types.index("ticket.read"), types.index("device.read")) < types.index("draft.proposed")


def test_a_conflict_rereads_the_ticket_and_carries_the_unchanged_comment_over(first, requester, approver, device,
                                                                              refadmin):
    """A 412 re-reads and re-plans. The comment is the same low-risk write, only the ticket version
    moved: its approval is carried over instead of asking the approver twice (DESIGN.md §7)."""
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    _decide(approver, task)
    agent_run(task_id=task.pk)  # the intent: a comment If-Match 1
    # Someone changes the ticket before the comment is sent.
    ReferenceTicketConnector().update_ticket(ticket_id=first.state["receipt"]["external_id"], if_match=1,
                                             changes={"assignee": "lee"})
    task = drive(task.pk)

    assert task.status == reducer.COMPLETED and task.termination_reason == "ticket_commented"
    types = _types(task)
    assert types.count("ticket.read") == 2 and "dispatch.conflict" in types
    conflicted, sent = Action.objects.filter(task=task).order_by("created_at")
    assert conflicted.status == ActionStatus.NOT_SENT and conflicted.last_error["status"] == 412
    assert refadmin.effects(conflicted.idempotency_key) == 0
    old, new = ApprovalRequest.objects.filter(task=task).order_by("created_at")
    assert old.status == ApprovalStatus.INVALIDATED and "412" in old.closed_reason
    assert (new.status, new.object_version, new.params["if_match"]) == (ApprovalStatus.APPROVED, 2, 2)
    assert f"carried over from approval {old.pk}" in new.reason and new.decided_by_id == old.decided_by_id
    assert sent.approval_id == new.pk and sent.status == ActionStatus.SUCCEEDED
    assert task.state["conflicts"] == 1 and task.budget_reserved == 0
    comments = refadmin.tickets()[0]["comments"]
    assert [c["idempotency_key"] for c in comments] == [sent.idempotency_key]
    assert task_actions_audit(task, remote=True) == []


def test_a_conflict_asks_again_when_the_comment_or_the_policy_changed(first, requester, approver, device, tenant,
                                                                     refadmin):
    """No carry-over once anything but the ticket version differs: here the policy moved to a new
    version between the approval and the re-plan."""
    from apps.approvals.models import ApprovalPolicy
    from apps.approvals.rules import DEFAULT_RULES

    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    _decide(approver, task)
    agent_run(task_id=task.pk)
    ReferenceTicketConnector().update_ticket(ticket_id=first.state["receipt"]["external_id"], if_match=1,
                                             changes={"assignee": "lee"})
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=DEFAULT_RULES)
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    new = _pending(task)
    assert (new.policy_version, new.object_version) == (2, 2) and new.decided_by_id is None
    _decide(approver, task)
    assert drive(task.pk).termination_reason == "ticket_commented"


def test_a_ticket_closed_meanwhile_makes_the_replan_a_new_ticket(first, requester, approver, device, refadmin):
    ticket_id = first.state["receipt"]["external_id"]
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    _decide(approver, task)
    agent_run(task_id=task.pk)
    ReferenceTicketConnector().update_ticket(ticket_id=ticket_id, if_match=1, changes={"status": "closed"})
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL and task.state["ticket"] is None
    assert _pending(task).tool == "ticket.create"
    _decide(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED and task.termination_reason == "ticket_created"
    assert len(refadmin.tickets()) == 2


def test_a_lost_comment_response_is_adopted_by_key_not_resent(first, requester, approver, device, refadmin):
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    _decide(approver, task)
    agent_run(task_id=task.pk)
    refadmin.fault("drop_after_commit")
    outbox_dispatch_batch()
    action = Action.objects.get(task=task)
    assert action.status == ActionStatus.UNKNOWN
    task = drive(task.pk)
    action.refresh_from_db()
    assert task.status == reducer.COMPLETED and action.status == ActionStatus.SUCCEEDED
    assert refadmin.effects(action.idempotency_key) == 1 and refadmin.requests(action.idempotency_key) == 1
    assert task.state["receipt"]["replayed"] is True
    assert task_actions_audit(task, remote=True) == []


# --- compensation ------------------------------------------------------------------------------

def _cancelled_with_ticket(requester, approver, device, refadmin) -> Task:
    """The ticket is created, its answer lost; the requester cancels; the receipt arrives after."""
    task = drive(_submit(requester, device).pk)
    _decide(approver, task)
    agent_run(task_id=task.pk)
    return created_then_cancelled(task.pk, canceller=requester, refadmin=refadmin)


@pytest.fixture
def compensating(requester, approver, device, kb, refservice, refadmin):
    task = _cancelled_with_ticket(requester, approver, device, refadmin)
    assert task.status == reducer.COMPENSATING
    return task


def test_a_cancelled_task_with_a_ticket_asks_to_close_it_and_closes_it_once_approved(compensating, approver,
                                                                                    refadmin):
    task = compensating
    ticket_id = task.state["receipt"]["external_id"]
    approval = _pending(task)
    assert (approval.tool, approval.object_type, approval.object_id) == ("ticket.update", "ticket", ticket_id)
    assert approval.params["changes"]["status"] == "closed" and "Compensation" in approval.side_effects
    assert refadmin.tickets()[0]["status"] == "open", "nothing is sent before the approval"

    _decide(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.CANCELLED
    assert task.state["compensation"]["status"] == "DONE"
    assert "compensation done" in task.termination_reason
    original, compensation = Action.objects.filter(task=task).order_by("created_at")
    assert compensation.compensates_id == original.pk and compensation.tool == "ticket.update"
    assert compensation.status == ActionStatus.SUCCEEDED
    ticket = refadmin.tickets()[0]
    assert ticket["status"] == "closed" and refadmin.effects(compensation.idempotency_key) == 1
    assert TicketMirror.objects.get(external_id=ticket_id).status == "closed"
    assert (task.budget_used, task.budget_reserved) == (5 + 2, 0)
    assert task_actions_audit(task, remote=True) == []


def test_a_rejected_compensation_leaves_the_ticket(compensating, approver, refadmin):
    _decide(approver, compensating, "reject", "the device owner wants the ticket kept")
    task = drive(compensating.pk)
    assert task.status == reducer.CANCELLED and task.state["compensation"]["status"] == "REJECTED"
    assert "rejected" in task.termination_reason
    assert Action.objects.filter(task=task).count() == 1
    assert refadmin.tickets()[0]["status"] == "open"


def test_a_compensation_that_keeps_conflicting_waits_for_a_person_then_retries(compensating, approver, admin_user,
                                                                              requester, refadmin, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "MAX_COMPENSATION_REPLANS": 1}
    task = compensating
    ticket_id = task.state["receipt"]["external_id"]
    _decide(approver, task)
    agent_run(task_id=task.pk)  # the compensation's intent, If-Match 1
    ReferenceTicketConnector().update_ticket(ticket_id=ticket_id, if_match=1, changes={"assignee": "lee"})
    task = drive(task.pk)
    assert task.status == reducer.WAITING_COMPENSATION
    assert "conflicts" in task.state["compensation"]["error"]
    conflicted = Action.objects.get(task=task, compensates__isnull=False)
    assert conflicted.status == ActionStatus.NOT_SENT and refadmin.effects(conflicted.idempotency_key) == 0
    assert [t.pk for t in compensations_waiting(principal=p(admin_user))] == [task.pk]

    with pytest.raises(Forbidden):
        compensation_settle(principal=p(requester), task_id=task.pk, decision="retry", note="again")
    task = compensation_settle(principal=p(admin_user), task_id=task.pk, decision="retry", note="ticket is quiet now")
    task = drive(task.pk)
    approval = _pending(task)
    assert approval.object_version == 2 and approval.params["if_match"] == 2
    _decide(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.CANCELLED and task.state["compensation"]["status"] == "DONE"
    assert refadmin.tickets()[0]["status"] == "closed"
    with pytest.raises(Conflict):
        compensation_settle(principal=p(admin_user), task_id=task.pk, decision="retry", note="again")
    assert task_actions_audit(task, remote=True) == []


def test_a_failed_compensation_can_be_recorded_as_done_by_hand(compensating, approver, admin_user, other_tenant_user,
                                                              settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "MAX_COMPENSATION_REPLANS": 1}
    task = compensating
    _decide(approver, task)
    agent_run(task_id=task.pk)
    ticket_id = task.state["receipt"]["external_id"]
    ReferenceTicketConnector().update_ticket(ticket_id=ticket_id, if_match=1, changes={"priority": "P4"})
    task = drive(task.pk)
    assert task.status == reducer.WAITING_COMPENSATION
    with pytest.raises(NotFound):
        compensation_settle(principal=p(other_tenant_user), task_id=task.pk, decision="done_by_hand", note="x")
    task = compensation_settle(principal=p(admin_user), task_id=task.pk, decision="done_by_hand",
                               note="closed it in the ticket system myself")
    assert task.status == reducer.CANCELLED and task.state["compensation"]["status"] == "RESOLVED"
    assert "done by hand" in task.termination_reason


def test_a_ticket_closed_by_someone_else_needs_no_compensation(compensating, approver, refadmin):
    task = compensating
    ticket_id = task.state["receipt"]["external_id"]
    ReferenceTicketConnector().update_ticket(ticket_id=ticket_id, if_match=1, changes={"status": "resolved"})
    _decide(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.CANCELLED and task.state["compensation"]["status"] == "RESOLVED"
    assert "not needed" in task.termination_reason and "already resolved" in task.termination_reason
    assert refadmin.tickets()[0]["status"] == "resolved"


# --- pinning: a reducer/1 task keeps reducer/1 ----------------------------------------------------

def test_a_task_pinned_to_reducer_1_keeps_its_plan_and_refuses_reducer_2_events(first, requester, approver, device,
                                                                                refadmin, monkeypatch):
    monkeypatch.setattr(reducer, "CURRENT", "reducer/1")
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    assert task.artifact_bundle["reducer"] == "reducer/1"
    assert "ticket.read" not in _types(task) and "ticket" not in task.state
    assert _pending(task).tool == "ticket.create", "reducer/1 always files a ticket"
    with pytest.raises(reducer.IllegalTransition, match="unknown event type"):
        task_append_event(task=task, event_type="dispatch.conflict", actor="test",
                          payload={"action_id": "x", "expected_version": 1})
    _decide(approver, task)
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED and len(refadmin.tickets()) == 2
    assert task_replay(task).ok


@pytest.fixture
def waiting_compensation(compensating, approver, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "MAX_COMPENSATION_REPLANS": 1}
    _decide(approver, compensating)
    agent_run(task_id=compensating.pk)
    ticket_id = compensating.state["receipt"]["external_id"]
    ReferenceTicketConnector().update_ticket(ticket_id=ticket_id, if_match=1, changes={"priority": "P4"})
    task = drive(compensating.pk)
    assert task.status == reducer.WAITING_COMPENSATION
    return task


def test_api_lists_and_settles_failed_compensations_for_admins_of_the_tenant(waiting_compensation, admin_user,
                                                                            approver, other_tenant_user):
    from django.urls import reverse
    from rest_framework.test import APIClient

    task = waiting_compensation
    api = APIClient()
    api.force_authenticate(approver)
    assert api.get(reverse("api-compensation-list")).status_code == 403
    api.force_authenticate(other_tenant_user)
    assert api.get(reverse("api-compensation-list")).json() == []
    url = reverse("api-compensation-decision", args=[task.pk])
    assert api.post(url, {"decision": "not_needed", "note": "x"}, format="json").status_code == 404
    api.force_authenticate(admin_user)
    [item] = api.get(reverse("api-compensation-list")).json()
    assert item["id"] == str(task.pk) and item["compensation"]["status"] == "FAILED"
    assert item["compensation"]["ticket"]["external_id"] == task.state["receipt"]["external_id"]
    assert api.post(url, {"decision": "undo", "note": "x"}, format="json").status_code == 400
    resp = api.post(url, {"decision": "not_needed", "note": "the owner wants it kept"}, format="json")
    assert resp.status_code == 200 and resp.json()["status"] == "CANCELLED"
    assert resp.json()["compensation"]["resolution"]["outcome"] == "not_needed"
    assert api.post(url, {"decision": "retry", "note": "x"}, format="json").status_code == 409


def test_page_shows_failed_compensations_and_settles_without_a_reload(client, waiting_compensation, admin_user):
    from django.urls import reverse

    task = waiting_compensation
    client.force_login(admin_user)
    html = client.get(reverse("reconciliation")).content.decode()
    ticket_id = task.state["receipt"]["external_id"]
    assert f"Close ticket {ticket_id}" in html and "gave up after 1 conflicts" in html
    url = reverse("compensation-settle", args=[task.pk])
    resp = client.post(url, {"decision": "retry", "note": ""}, HTTP_HX_REQUEST="true")
    assert resp.status_code == 422 and "say why" in resp.content.decode() and "<html" not in resp.content.decode()
    resp = client.post(url, {"decision": "retry", "note": "quiet now"}, HTTP_HX_REQUEST="true")
    assert resp.status_code == 200 and "Settled: the task is Undoing after cancel" in resp.content.decode()


def test_the_requesters_page_shows_the_comment_and_the_compensation(client, first, requester, approver, device,
                                                                     refadmin):
    from django.urls import reverse

    client.force_login(requester)
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    html = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "review the proposed comment on ticket" in html and "no second ticket" in html
    _decide(approver, task)
    task = drive(task.pk)
    html = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert f"Your report was added to ticket <strong>{first.state['receipt']['external_id']}</strong>" in html

    # A fresh device, so the next request files (and then compensates) its own ticket.
    from tests.factories import DeviceFactory

    other = DeviceFactory(tenant=device.tenant, asset_tag="PRN-0102")
    task = _cancelled_with_ticket(requester, approver, other, refadmin)
    html = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert task.status == reducer.COMPENSATING and "an approver decides whether to close it" in html
    assert "Cancel request" not in html
    _decide(approver, task)
    task = drive(task.pk)
    html = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "Closed again after the cancel" in html


def test_the_approval_queue_shows_a_comment_and_a_compensation_with_their_ticket(client, compensating, approver):
    from django.urls import reverse

    client.force_login(approver)
    html = client.get(reverse("approval-queue")).content.decode()
    ticket_id = compensating.state["receipt"]["external_id"]
    assert f"ticket {ticket_id} at version 1" in html and "status: closed" in html and "If-Match" in html


def test_a_ticket_gone_before_the_comment_is_a_conflict_and_the_replan_files_a_new_one(first, requester, approver,
                                                                                      device, refadmin):
    task = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    _decide(approver, task)
    agent_run(task_id=task.pk)
    refadmin.client.post("/_admin/reset")  # the ticket system lost every ticket
    task = drive(task.pk)
    conflicted = Action.objects.get(task=task)
    assert conflicted.status == ActionStatus.NOT_SENT and conflicted.last_error["status"] == 404
    assert "dispatch.conflict" in _types(task)
    assert task.status == reducer.WAITING_APPROVAL and _pending(task).tool == "ticket.create"


def test_the_trace_shows_the_compensation(client, compensating, approver, admin_user):
    from django.urls import reverse

    _decide(approver, compensating)
    task = drive(compensating.pk)
    client.force_login(admin_user)
    html = client.get(reverse("task-trace", args=[task.pk])).content.decode()
    assert "compensation.requested" in html and "ticket.update" in html


# --- review findings (helper review of item 5) ------------------------------------------------------

def test_a_cancelled_requests_ticket_that_carries_another_report_stays_open(requester, approver, device, kb,
                                                                           refservice, refadmin):
    """F1: A's ticket got B's comment before A was cancelled: closing it would bury B's report.

    A receipt now completes its task in the same commit, so a cancel cannot come between them;
    a task whose receipt an earlier release recorded alone (leaving the answer to the agent) can
    still be there after an upgrade, and that is the state built here."""
    import apps.outbox.settlement as settlement

    a = drive(_submit(requester, device).pk)
    _decide(approver, a)
    agent_run(task_id=a.pk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settlement, "completion_event", lambda state: None)
        outbox_dispatch_batch()  # A's ticket exists (receipt); A's agent has not composed the answer yet
        settle_receipts()
    b = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    assert Task.objects.get(pk=a.pk).status == reducer.DISPATCHING
    _decide(approver, b)
    b = drive(b.pk)
    assert b.termination_reason == "ticket_commented"
    task_cancel(principal=p(requester), task_id=a.pk, reason="fixed itself")
    a = drive(a.pk)
    assert a.status == reducer.CANCELLED and a.state["compensation"]["status"] == "RESOLVED"
    assert str(b.pk) in a.state["compensation"]["resolution"]["note"] and "stays open" in a.termination_reason
    assert refadmin.tickets()[0]["status"] == "open"
    assert not ApprovalRequest.objects.filter(task=a, tool="ticket.update").exists()


def test_a_ticket_about_to_be_compensated_takes_no_new_comment(compensating, requester, approver, device, refadmin):
    """F1: while A's compensation is pending, B's report files its own ticket."""
    b = drive(_submit(requester, device, "Paper jams at the fuser exit on every duplex job from tray 2.").pk)
    assert b.state["ticket"] is None and _pending(b).tool == "ticket.create"


def test_a_failed_compensation_past_the_deadline_just_waits(waiting_compensation):
    """F3: no task.failed attempt (and no refused event) for a task waiting for a person."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.events.models import RefusedEvent

    Task.objects.filter(pk=waiting_compensation.pk).update(deadline_at=timezone.now() - timedelta(days=1))
    refused = RefusedEvent.objects.filter(task=waiting_compensation).count()
    agent_run(task_id=waiting_compensation.pk)
    assert Task.objects.get(pk=waiting_compensation.pk).status == reducer.WAITING_COMPENSATION
    assert RefusedEvent.objects.filter(task=waiting_compensation).count() == refused


def test_a_replanning_compensation_gives_up_when_the_ticket_system_stays_unreadable(compensating, approver,
                                                                                   refservice, settings):
    """F4: the compensation's own window bounds the re-reads."""
    _decide(approver, compensating)
    agent_run(task_id=compensating.pk)
    ticket_id = compensating.state["receipt"]["external_id"]
    ReferenceTicketConnector().update_ticket(ticket_id=ticket_id, if_match=1, changes={"assignee": "lee"})
    outbox_dispatch_batch()  # 412: the compensation re-plans
    assert Task.objects.get(pk=compensating.pk).state["compensation"]["status"] == "REPLANNING"
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_URL": "http://127.0.0.1:9", "TASK_DEADLINE_SECONDS": 0}
    task = drive(compensating.pk)
    assert task.status == reducer.WAITING_COMPENSATION
    assert "could not be read" in task.state["compensation"]["error"]


def test_a_nul_character_in_a_note_is_a_clear_400_and_records_nothing(client, waiting_compensation, admin_user):
    """F5."""
    from django.urls import reverse

    client.force_login(admin_user)
    resp = client.post(reverse("compensation-settle", args=[waiting_compensation.pk]),
                       {"decision": "not_needed", "note": "kept\x00open"}, HTTP_HX_REQUEST="true")
    assert resp.status_code == 400 and resp.json()["error"] == "invalid_input"
    assert Task.objects.get(pk=waiting_compensation.pk).status == reducer.WAITING_COMPENSATION


def test_the_api_says_what_a_compensating_task_waits_for(waiting_compensation, requester):
    """F7."""
    from django.urls import reverse
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(requester)
    body = api.get(reverse("api-task-detail", args=[waiting_compensation.pk])).json()
    assert body["status"] == "WAITING_COMPENSATION" and "failed compensation" in body["waiting_for"]
