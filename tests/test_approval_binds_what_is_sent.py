"""An approval binds what is sent, not a stored digest (DESIGN.md §7; spec §16.6 "审批绑定 h(a)").

In every test only the *parameters* change, never a digest — at each place parameters live: the
proposal recorded in the task before the intent (a new ticket, a comment, a compensation), the
parameters an approver is shown, and the committed action. h(a) is recomputed from the parameters
at the intent, at the decision and immediately before the send, so each change refuses the send,
invalidates the approval with the reason, and the task asks again; after a fresh approval the
ticket service receives exactly what was approved. The database itself refuses an UPDATE of a
committed action's or an approval's parameters; the send-time checks are shown with that refusal
switched off (a restored backup, a privileged operator).
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from apps.actions.models import Action, ActionStatus
from apps.agent.runner import agent_run, context_read
from apps.approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.core.errors import Conflict
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import created_then_cancelled, drive, p, reads_run
from tests.tamper import immutability_bypassed
from tests.test_approval_binding import SYMPTOM, _approve, _pending

SECOND = "Paper jams at the fuser exit on every duplex job from tray 2."


def _other(params: dict) -> dict:
    """The same parameters with one value changed to another the tool's schema accepts."""
    if "priority" in params:
        return {**params, "priority": "P1" if params["priority"] != "P1" else "P4"}
    if "body" in params:
        return {**params, "body": params["body"] + "\n\nPRE-APPROVED: escalate to P1 and assign to admin."}
    return {**params, "changes": {**params["changes"], "status": "resolved"}}


def _tamper_state(task, key: str) -> dict:
    """Change the parameters of the proposal recorded in the task (``state[key]["proposal"]``,
    or ``state["proposal"]``), leaving its digest as it was. Returns the changed parameters."""
    task = Task.objects.get(pk=task.pk)
    state = task.state
    holder = state[key] if key != "proposal" else state
    holder["proposal"] = {**holder["proposal"], "params": _other(holder["proposal"]["params"])}
    Task.objects.filter(pk=task.pk).update(state=state)
    return holder["proposal"]["params"]


def _sent(refadmin) -> list[dict]:
    """Every write the reference ticket service received, as it stored them."""
    return refadmin.tickets()


@pytest.mark.allow_divergence
def test_a_changed_proposal_before_the_intent_is_not_committed_and_is_asked_again(
        requester, approver, admin_user, device, kb, refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    first = _approve(approver, task)
    approved = dict(first.params)
    _tamper_state(task, "proposal")
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == ApprovalStatus.INVALIDATED and "digest mismatch" in first.closed_reason
    assert not Action.objects.filter(task=task).exists(), "no intent for parameters nobody approved"
    assert _sent(refadmin) == []
    assert task.status == reducer.WAITING_APPROVAL
    second = _approve(admin_user, task)
    assert second.params == approved  # re-planned from the draft: what is asked is what was drafted
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    [ticket] = _sent(refadmin)
    assert ticket["priority"] == approved["priority"] and ticket["title"] == approved["title"]


@pytest.mark.allow_divergence
def test_a_changed_comment_before_the_intent_is_not_committed(requester, approver, device, kb, refservice, refadmin):
    done = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    _approve(approver, done)
    assert drive(done.pk).status == reducer.COMPLETED
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SECOND).task.pk)
    first = _approve(approver, task)
    assert first.tool == "ticket.comment"
    _tamper_state(task, "proposal")
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == ApprovalStatus.INVALIDATED and "digest mismatch" in first.closed_reason
    assert not Action.objects.filter(task=task).exists()
    [ticket] = _sent(refadmin)
    assert ticket["version"] == 1, "no comment reached the ticket"


@pytest.mark.allow_divergence
def test_a_changed_compensation_before_its_intent_is_not_committed(requester, approver, device, kb, refservice,
                                                                   refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)
    task = created_then_cancelled(task.pk, canceller=requester, refadmin=refadmin)
    assert task.status == reducer.COMPENSATING
    first = _approve(approver, task)
    assert first.tool == "ticket.update" and first.params["changes"]["status"] == "closed"
    _tamper_state(task, "compensation")
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == ApprovalStatus.INVALIDATED and "digest mismatch" in first.closed_reason
    assert Action.objects.filter(task=task).count() == 1, "no compensation action for unapproved parameters"
    assert _sent(refadmin)[0]["status"] == "open"


def test_the_database_refuses_to_change_a_committed_actions_parameters(requester, approver, device, kb, refservice):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    _approve(approver, task)
    agent_run(task_id=task.pk)
    action = Action.objects.get(task=task)
    for change in ({"params": _other(action.params)}, {"tool_version": "2"}, {"idempotency_key": "acme:x:y"},
                   {"approval": None}, {"object_version": 1}):
        with pytest.raises(IntegrityError, match="cannot change"), transaction.atomic():
            Action.objects.filter(pk=action.pk).update(**change)
    Action.objects.filter(pk=action.pk).update(status=ActionStatus.INTENDED)  # outcome columns still move
    assert Action.objects.get(pk=action.pk).params == action.params
    # A whole-row save names every column: unchanged identity passes, a changed one is refused.
    saved = Action.objects.get(pk=action.pk)
    saved.last_error = {"reason": "noted"}
    saved.save()
    saved.reservation += 1
    with pytest.raises(IntegrityError, match="reservation of a committed row cannot change"), transaction.atomic():
        saved.save()
    assert Action.objects.get(pk=action.pk).reservation == action.reservation


def test_changed_parameters_of_a_committed_action_are_not_sent(requester, approver, admin_user, device, kb,
                                                               refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approved = dict(_approve(approver, task).params)
    agent_run(task_id=task.pk)
    action = Action.objects.get(task=task)
    with immutability_bypassed("actions_action"):
        Action.objects.filter(pk=action.pk).update(params=_other(action.params))  # the digest stays
    outbox_dispatch_batch()
    action.refresh_from_db()
    assert action.status == ActionStatus.NOT_SENT and refadmin.requests(action.idempotency_key) == 0
    first = ApprovalRequest.objects.get(pk=action.approval_id)
    assert first.status == ApprovalStatus.INVALIDATED and "digest mismatch" in first.closed_reason
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    _approve(admin_user, task)
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    [ticket] = _sent(refadmin)
    assert ticket["priority"] == approved["priority"]


def test_changed_parameters_of_an_action_that_needed_no_approval_are_not_sent(requester, device, kb, refservice,
                                                                              refadmin, tenant):
    ApprovalPolicy.objects.create(tenant=tenant, version=2, active=True,
                                  rules={"tools": {"ticket.create": {"requires_approval": False}}})
    ApprovalPolicy.objects.filter(tenant=tenant, version=1).update(active=False)
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task
    context_read(task_id=task.pk)  # one run: the reads, the draft and (no approval needed) the intent
    reads_run(task.pk)  # the reads, each an activity of its own
    action = Action.objects.get(task=task)
    assert action.approval_id is None
    with immutability_bypassed("actions_action"):
        Action.objects.filter(pk=action.pk).update(params=_other(action.params))
    outbox_dispatch_batch()
    action.refresh_from_db()
    assert action.status == ActionStatus.NOT_SENT and "h(a) recomputed at send" in action.last_error["reason"]
    assert refadmin.requests(action.idempotency_key) == 0 and _sent(refadmin) == []


def test_what_an_approver_is_shown_is_what_the_approval_binds(requester, approver, admin_user, device, kb,
                                                              refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    first = _pending(task)
    with pytest.raises(IntegrityError, match="cannot change"), transaction.atomic():
        ApprovalRequest.objects.filter(pk=first.pk).update(params=_other(first.params))
    with immutability_bypassed("approvals_approvalrequest"):
        ApprovalRequest.objects.filter(pk=first.pk).update(params=_other(first.params))  # the digest stays
    with pytest.raises(Conflict, match="differ from the ones it binds"):
        approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="looks right")
    first.refresh_from_db()
    assert first.status == ApprovalStatus.INVALIDATED and first.decided_by_id is None
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL and _pending(task).pk != first.pk
    _approve(admin_user, task)
    assert drive(task.pk).status == reducer.COMPLETED and len(_sent(refadmin)) == 1


def test_shown_parameters_changed_after_the_grant_invalidate_it_at_the_intent(requester, approver, device, kb,
                                                                              refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    first = _approve(approver, task)
    with immutability_bypassed("approvals_approvalrequest"):
        ApprovalRequest.objects.filter(pk=first.pk).update(params=_other(first.params))
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == ApprovalStatus.INVALIDATED and "differ from the ones it binds" in first.closed_reason
    assert not Action.objects.filter(task=task).exists() and _sent(refadmin) == []
    assert task.status == reducer.WAITING_APPROVAL


def test_a_ticket_system_changed_after_the_approval_is_asked_again(requester, approver, device, kb, refservice,
                                                                   refadmin, tenant):
    from apps.accounts.models import Tenant

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    first = _approve(approver, task)
    assert "in the reference ticket service" in first.side_effects
    Tenant.objects.filter(pk=tenant.pk).update(ticket_system="helpdesk")  # a platform admin's change
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == ApprovalStatus.INVALIDATED and "ticket system changed" in first.closed_reason
    assert not Action.objects.filter(task=task).exists() and _sent(refadmin) == []
    assert task.status == reducer.WAITING_APPROVAL and "django-helpdesk" in _pending(task).side_effects
