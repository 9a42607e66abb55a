"""A deactivated account acts no more (spec §16.1; DESIGN.md §7 "re-check at the moment of use"):
``User.is_active`` off counts as a revoked membership for the requester whose ticket is pending
and for the approver whose approval is about to be used — at the intent and at dispatch."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from apps.actions.models import Action, ActionStatus
from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _deactivate(user) -> None:
    get_user_model().objects.filter(pk=user.pk).update(is_active=False)


def _submitted_and_approved(requester, approver, device):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    return task, approval


def test_a_deactivated_requesters_ticket_is_not_filed(requester, approver, device, kb, refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    _deactivate(requester)  # the membership itself stays active
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.FAILED and "requester" in task.termination_reason
    assert not Action.objects.filter(task=task).exists() and refadmin.tickets() == []


def test_an_approver_deactivated_before_the_intent_leaves_no_valid_approval(requester, approver, admin_user, device,
                                                                            kb, refservice, refadmin):
    task, approval = _submitted_and_approved(requester, approver, device)
    _deactivate(approver)
    task = drive(task.pk)
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.INVALIDATED and "account is deactivated" in approval.closed_reason
    assert not Action.objects.filter(task=task).exists() and refadmin.tickets() == []
    assert task.status == reducer.WAITING_APPROVAL


def test_an_approver_deactivated_after_the_intent_has_no_valid_approval_at_dispatch(requester, approver, device, kb,
                                                                                    refservice, refadmin):
    task, approval = _submitted_and_approved(requester, approver, device)
    agent_run(task_id=task.pk)  # the intent is committed under the approval
    _deactivate(approver)
    outbox_dispatch_batch()
    action = Action.objects.get(task=task)
    approval.refresh_from_db()
    assert action.status == ActionStatus.NOT_SENT and refadmin.requests(action.idempotency_key) == 0
    assert approval.status == ApprovalStatus.INVALIDATED and "account is deactivated" in approval.closed_reason


def test_a_requester_deactivated_after_the_intent_gets_no_ticket(requester, approver, device, kb, refservice,
                                                                 refadmin):
    task, _ = _submitted_and_approved(requester, approver, device)
    agent_run(task_id=task.pk)  # the intent is committed
    _deactivate(requester)
    outbox_dispatch_batch()
    action = Action.objects.get(task=task)
    assert action.status == ActionStatus.NOT_SENT and refadmin.requests(action.idempotency_key) == 0
    task = drive(task.pk)
    assert task.status == reducer.FAILED and refadmin.tickets() == []


def test_a_deactivated_requester_gets_no_ticket_where_no_approval_is_needed(requester, device, kb, refservice,
                                                                            refadmin, tenant):
    from apps.approvals.models import ApprovalPolicy

    ApprovalPolicy.objects.filter(tenant=tenant).update(active=False)
    ApprovalPolicy.objects.create(tenant=tenant, version=2, active=True,
                                  rules={"tools": {"ticket.create": {"requires_approval": False}}})
    import apps.agent.reads as reads

    read = reads.open_ticket_read

    def read_then_deactivated(**kwargs):
        ticket = read(**kwargs)  # the evidence, the device and its ticket are read while the account is active
        _deactivate(requester)
        return ticket

    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reads, "open_ticket_read", read_then_deactivated)
        task = drive(task.pk)  # the ticket read completes the join: the same run drafts next and reaches the intent
    assert task.status == reducer.FAILED and "requester" in task.termination_reason
    assert not Action.objects.filter(task=task).exists() and refadmin.tickets() == []
