"""Retention of notifications (apps/notifications/retention.py): a finished notification's free text
(the agent's questions, a reason's details, an approver's words) is emptied past the tenant's
``notifications_days``; what the page line reads stays; unsent rows and rows of open tasks are left."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.notifications.compose import page_line
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.projections import message_id_for
from apps.notifications.retention import purged_context
from apps.retention.models import RetentionPolicy
from apps.retention.purge import purge_run
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import p

pytestmark = pytest.mark.django_db

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _note(user, task, kind, delivery, days, **context) -> Notification:
    n = Notification(tenant_id=task.tenant_id, recipient=user, kind=kind, task=task, status=delivery,
                     context={"asset_tag": "PRN-0417", **context})
    n.message_id = message_id_for(n.pk)
    n.save(force_insert=True)
    then = timezone.now() - timedelta(days=days)
    Notification.objects.filter(pk=n.pk).update(created_at=then, sent_at=then if delivery == "SENT" else None)
    return n


def test_a_sent_notifications_words_go_past_the_policy_and_its_line_still_reads(requester, device, tenant):
    RetentionPolicy.objects.create(tenant=tenant, notifications_days=10)
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    Task.objects.filter(pk=task.pk).update(status=reducer.CANCELLED)
    asked = _note(requester, task, NotificationKind.INPUT_REQUESTED, DeliveryStatus.SENT, 20,
                  questions=["Which tray was in use when my badge J. Smith printed?"])
    ended = _note(requester, task, NotificationKind.TASK_ENDED, DeliveryStatus.SKIPPED, 20, status="CANCELLED",
                  reason="cancelled: J. Smith fixed it himself", approver_reason="not our printer")
    recent = _note(requester, task, NotificationKind.INPUT_REQUESTED, DeliveryStatus.SENT, 5, questions=["Which?"])
    pending = _note(requester, task, NotificationKind.TICKET_CREATED, DeliveryStatus.PENDING, 20, ticket="REF-1")
    line = page_line(ended)
    run = purge_run()
    assert run.tables["notifications_notification"]["rows"] == 2
    for n in (asked, ended, recent, pending):
        n.refresh_from_db()
    assert asked.context == {"asset_tag": "PRN-0417", "questions": []} and asked.purged_at
    assert ended.context["reason"] == "cancelled" and ended.context["approver_reason"] == ""
    assert "Smith" not in str(ended.context) and page_line(ended) == line
    assert recent.purged_at is None and recent.context["questions"] == ["Which?"]
    assert pending.purged_at is None and pending.context["ticket"] == "REF-1"


def test_a_notification_of_an_open_task_keeps_its_words(requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    assert task.status not in reducer.TERMINAL
    asked = _note(requester, task, NotificationKind.INPUT_REQUESTED, DeliveryStatus.SENT, 400, questions=["Which?"])
    purge_run()
    asked.refresh_from_db()
    assert asked.purged_at is None and asked.context["questions"] == ["Which?"]


def test_the_purged_context_keeps_what_a_digest_lists():
    digest = {"items": [{"approval_id": "a", "tool": "ticket.create", "asset_tag": "PRN-1", "task_id": "t"}]}
    assert purged_context(digest) == digest
    assert purged_context({"reason": "proposal_rejected: no"})["reason"] == "proposal_rejected"
