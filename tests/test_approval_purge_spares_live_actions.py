"""Retention never takes the copy of an approval that still authorizes a write (ADR 0019's floor:
nothing of an open task or of a task with an unreconciled action is touched; ADR 0020).

An approval's copies are purged "once its task is purged". A task's ``purged`` marker stays when the
task takes events after its purge — a late receipt on a cancelled task opens a compensation
(``COMPENSATING``) under a new approval — so the marker alone does not say the task is finished. A
purged approval is refused as authority to send (``approval_check_binding``: ``purged``) and its
decision can no longer move, so purging a live one would leave what a person approved unsendable and
the step that tries to invalidate it failing on the trigger, again and again.
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from apps.actions.models import Action, ActionStatus
from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.retention import purge_approvals_batch
from apps.approvals.services import approval_decide
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.retention.purge import purge_run
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import created_then_cancelled, drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
PURGE = ("UPDATE approvals_approvalrequest SET params = faultdesk_approval_purged_params(params, %s), "
         "evidence = faultdesk_approval_purged_evidence(evidence, %s), purged = %s, purged_at = now() "
         "WHERE id = %s")


def _mark_purged(task_id, level: str = "excerpts") -> None:
    """The task as a purge left it before it took the events that opened it again."""
    Task.objects.filter(pk=task_id).update(purged=level, purged_at=timezone.now())


def test_a_compensation_approved_on_a_task_purged_earlier_is_kept_and_carried_out(
        requester, approver, admin_user, device, kb, refservice, refadmin):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    task = created_then_cancelled(task.pk, canceller=admin_user, refadmin=refadmin)
    assert task.status == reducer.COMPENSATING
    _mark_purged(task.pk)
    compensation = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=compensation.pk, decision="approve", reason="close it")
    # given: a purge run comes between the decision and the agent's next step
    purge_run()
    compensation.refresh_from_db()
    assert compensation.purged == "", "the copy of an approval whose write is still to come was purged"
    # then: what the approver approved is carried out
    task = drive(task.pk)
    assert task.state["compensation"]["status"] == "DONE"
    assert refadmin.tickets()[0]["status"] == "closed"


def test_the_trigger_refuses_the_purge_of_an_approval_whose_action_is_not_settled(committed):
    approval = ApprovalRequest.objects.get(task=committed, status=ApprovalStatus.APPROVED)
    assert Action.objects.get(approval=approval).status == ActionStatus.INTENDED
    # the task row claims a purge (a crafted UPDATE, or a marker left from before it opened again)
    _mark_purged(committed.pk, "payload")
    assert purge_approvals_batch(committed.tenant_id, "payload", limit=10, at=timezone.now()).rows == 0
    with pytest.raises(IntegrityError, match="not finished or has an unreconciled action"), \
            transaction.atomic(), connection.cursor() as cur:
        cur.execute(PURGE, ["payload", "payload", "payload", approval.pk])
    approval.refresh_from_db()
    assert approval.purged == ""
    # and the approved ticket is still sent
    outbox_dispatch_batch()
    assert Action.objects.get(approval=approval).status == ActionStatus.SUCCEEDED
