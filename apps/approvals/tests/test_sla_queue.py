"""Service levels on the approval queue (apps/tickets/sla.py): an approval carries its request's
respond-by date when it is asked, the pending queue puts what would breach the SLA first, and each
row says how long is left — or how late it is — in the reader's language."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from apps.approvals.models import ApprovalRequest
from apps.approvals.selectors import approval_queue
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from apps.tickets.models import SlaPolicy
from apps.tickets.selectors import sla_policy_for
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _waiting(requester, device, urgency="high") -> Task:
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency=urgency).task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    return task


@pytest.mark.django_db
def test_an_approval_carries_its_requests_respond_by_date(requester, device, kb, tenant):
    SlaPolicy.objects.create(tenant=tenant, workdays=list(range(7)),
                             targets={p: {"respond": 120, "resolve": 600, "around_the_clock": True}
                                      for p in ("P1", "P2", "P3", "P4")})
    task = _waiting(requester, device)
    approval = ApprovalRequest.objects.get(task=task)
    assert approval.respond_by == task.created_at + timedelta(minutes=120)
    priority = approval.params["priority"]
    assert approval.respond_by == sla_policy_for(tenant.pk).deadlines(task.created_at, priority).respond_by


@pytest.mark.django_db
def test_the_pending_queue_puts_the_soonest_due_first_and_marks_the_late(requester, approver, device, kb):
    tasks = [_waiting(requester, device) for _ in range(3)]
    now = timezone.now()
    dues = [now + timedelta(hours=5), now - timedelta(minutes=10), now + timedelta(minutes=20)]
    for task, due in zip(tasks, dues, strict=True):
        ApprovalRequest.objects.filter(task=task).update(respond_by=due)
    ApprovalRequest.objects.filter(task=tasks[0]).update(created_at=now + timedelta(seconds=5))  # newest
    _page, rows = approval_queue(principal=p(approver), status="PENDING", now=now)
    assert [r.approval.task_id for r in rows] == [tasks[1].pk, tasks[2].pk, tasks[0].pk]
    assert [(r.overdue, r.due_soon) for r in rows] == [(True, False), (False, True), (False, False)]
    # every other view stays newest first
    _page, rows = approval_queue(principal=p(approver), status="ALL", now=now)
    assert rows[0].approval.task_id == tasks[0].pk


@pytest.mark.django_db
def test_an_approval_without_a_due_date_comes_after_those_with_one(requester, approver, device, kb):
    first, second = _waiting(requester, device), _waiting(requester, device)
    ApprovalRequest.objects.filter(task=second).update(respond_by=None)
    ApprovalRequest.objects.filter(task=first).update(respond_by=timezone.now() + timedelta(days=3))
    _page, rows = approval_queue(principal=p(approver), status="PENDING")
    assert [r.approval.task_id for r in rows] == [first.pk, second.pk]


@pytest.mark.django_db
def test_the_row_says_the_time_left_or_how_late_in_the_readers_language(client, requester, approver, device, kb):
    late, soon = _waiting(requester, device), _waiting(requester, device)
    ApprovalRequest.objects.filter(task=late).update(respond_by=timezone.now() - timedelta(hours=2, minutes=1))
    ApprovalRequest.objects.filter(task=soon).update(respond_by=timezone.now() + timedelta(minutes=30, seconds=30))
    client.force_login(approver)
    html = client.get(reverse("approval-queue")).content.decode()
    assert "overdue by 2\xa0hours" in html and "30\xa0minutes left" in html
    zh = client.get(reverse("approval-queue"), HTTP_ACCEPT_LANGUAGE="zh-CN").content.decode()
    assert "已超时 2\xa0小时" in zh and "剩余 30\xa0分钟" in zh


@pytest.mark.django_db
def test_a_broken_policy_never_refuses_an_approval(requester, device, kb, tenant):
    SlaPolicy.objects.create(tenant=tenant, timezone="Nowhere/Atlantis",  # saved past the form's check
                             targets={p: {"around_the_clock": False} for p in ("P1", "P2", "P3", "P4")})
    task = _waiting(requester, device)
    assert ApprovalRequest.objects.get(task=task).respond_by is None


def test_the_sla_policy_form_refuses_a_calendar_without_working_time(db, tenant):
    from django.core.exceptions import ValidationError

    policy = SlaPolicy(tenant=tenant, workdays=[])
    with pytest.raises(ValidationError):
        policy.full_clean()


@pytest.mark.django_db
def test_the_requesters_page_shows_the_due_dates_in_their_language(client, requester, device, kb, tenant):
    SlaPolicy.objects.create(tenant=tenant, workdays=list(range(7)),
                             targets={p: {"respond": 90, "resolve": 600, "around_the_clock": True}
                                      for p in ("P1", "P2", "P3", "P4")})
    task = _waiting(requester, device)
    client.force_login(requester)
    html = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    due = (task.created_at + timedelta(minutes=90)).strftime("%Y-%m-%d %H:%M")
    assert f"an answer is due by {due} UTC" in html
    zh = client.get(reverse("task-detail", args=[task.pk]), HTTP_ACCEPT_LANGUAGE="zh-CN").content.decode()
    assert f"应于 {due} UTC 前答复" in zh


@pytest.mark.django_db
def test_saving_the_policy_moves_the_pending_approvals_due_dates(requester, device, kb, tenant):
    policy = SlaPolicy.objects.create(tenant=tenant, workdays=list(range(7)),
                                      targets={q: {"respond": 600, "resolve": 6000, "around_the_clock": True}
                                               for q in ("P1", "P2", "P3", "P4")})
    task = _waiting(requester, device)
    policy.targets = {q: {"respond": 5, "resolve": 6000, "around_the_clock": True} for q in ("P1", "P2", "P3", "P4")}
    policy.save()
    assert ApprovalRequest.objects.get(task=task).respond_by == task.created_at + timedelta(minutes=5)
    policy.delete()  # back to the defaults
    assert ApprovalRequest.objects.get(task=task).respond_by == sla_policy_for(tenant.pk).deadlines(
        task.created_at, ApprovalRequest.objects.get(task=task).params["priority"]).respond_by


@pytest.mark.django_db
def test_a_rejected_proposal_stays_rejected_after_the_policy_changed(requester, approver, device, kb, tenant):
    from apps.approvals.services import approval_decide

    policy = SlaPolicy.objects.create(tenant=tenant, workdays=list(range(7)),
                                      targets={q: {"respond": 60, "resolve": 600, "around_the_clock": True}
                                               for q in ("P1", "P2", "P3", "P4")})
    task = _waiting(requester, device)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="reject", reason="not a fault")
    policy.targets = {q: {"respond": 60, "resolve": 900, "around_the_clock": True} for q in ("P1", "P2", "P3", "P4")}
    policy.save()
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED and task.termination_reason == "proposal_rejected"
