"""Beat: wake tasks whose pending approval expired so the controller records the expiry."""

from __future__ import annotations

from celery import shared_task
from django.utils import timezone

from apps.core import queue


@shared_task(name=queue.EXPIRE_APPROVALS)
def expire_approvals() -> int:
    from apps.approvals.models import ApprovalRequest, ApprovalStatus

    ids = list(
        ApprovalRequest.objects.filter(status=ApprovalStatus.PENDING, expires_at__lte=timezone.now())
        .values_list("task_id", flat=True)[:200]
    )
    for task_id in ids:
        queue.send_now(queue.AGENT_STEP, task_id)
    return len(ids)
