"""Beat: wake tasks whose pending approval expired so the controller records the expiry."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone


@shared_task(name="apps.approvals.tasks.expire_approvals")
def expire_approvals() -> int:
    from apps.approvals.models import ApprovalRequest, ApprovalStatus
    from apps.tasks.tasks import agent_step

    ids = list(
        ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING, expires_at__lte=timezone.now())
        .values_list("task_id", flat=True)[:200]
    )
    for task_id in ids:
        agent_step.delay(str(task_id))
    return len(ids)
