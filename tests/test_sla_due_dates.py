"""A ticket is created with its service-level due date (apps/tickets/sla.py): the agent sets it
from the tenant's policy when the draft is recorded, the approver sees it among the parameters the
approval binds, and the ticket system receives it."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
import pytest

from apps.actions.models import Action
from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.services import task_submit
from apps.tickets.models import SlaPolicy
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.mark.django_db
def test_the_ticket_is_created_with_the_policys_resolve_by_date(client, requester, approver, device, kb, tenant,
                                                                 refservice):
    SlaPolicy.objects.create(tenant=tenant, workdays=list(range(7)),
                             targets={p: {"respond": 30, "resolve": 600, "around_the_clock": True}
                                      for p in ("P1", "P2", "P3", "P4")})
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    due = (task.created_at + timedelta(minutes=600)).replace(microsecond=0)
    draft = TaskEvent.objects.get(task=task, type="draft.proposed").payload["draft"]
    assert datetime.fromisoformat(draft["ticket"]["due_at"]) == due  # recorded with the draft
    approval = ApprovalRequest.objects.get(task=task)
    assert datetime.fromisoformat(approval.params["due_at"]) == due  # bound by the approval's digest
    client.force_login(approver)
    assert f"to be resolved by {due.strftime('%Y-%m-%d %H:%M')} UTC" in client.get("/approvals/").content.decode()

    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    action = Action.objects.get(task=task)
    [ticket] = httpx.get(f"{refservice.url}/tickets", params={"idempotency_key": action.idempotency_key},
                         headers={"Authorization": "Bearer test-key"}).json()["results"]
    assert datetime.fromisoformat(ticket["due_at"]) == due


@pytest.mark.django_db
def test_a_tenant_without_a_policy_gets_the_default_business_hours_due_date(requester, device, kb):
    from apps.tickets.sla import Policy

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    params = ApprovalRequest.objects.get(task=task).params
    expected = Policy().deadlines(task.created_at, params["priority"]).resolve_by
    assert datetime.fromisoformat(params["due_at"]) == expected.replace(microsecond=0)
