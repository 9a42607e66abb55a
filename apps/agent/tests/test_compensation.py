"""The compensation approval ("close the ticket") names who asked for it — the person who
cancelled — so an admin who cancels cannot approve the compensation they caused; someone else does."""

from __future__ import annotations

import pytest

from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.core.errors import Forbidden
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import created_then_cancelled, drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def test_an_admin_who_cancels_cannot_approve_the_compensation(requester, approver, admin_user, device, kb,
                                                              refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    task = created_then_cancelled(task.pk, canceller=admin_user, refadmin=refadmin,
                                  reason="duplicate of another report")
    assert task.status == reducer.COMPENSATING
    compensation = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    assert compensation.tool == "ticket.update" and compensation.requested_by_id == admin_user.pk
    with pytest.raises(Forbidden, match="your own request"):
        approval_decide(principal=p(admin_user), approval_id=compensation.pk, decision="approve", reason="mine")
    approval_decide(principal=p(approver), approval_id=compensation.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.state["compensation"]["status"] == "DONE" and refadmin.tickets()[0]["status"] == "closed"
