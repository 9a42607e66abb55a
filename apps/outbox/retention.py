"""Retention of finished outbox rows (DESIGN.md §13 "Retention").

A row is finished once it is ``DELIVERED``, ``FAILED`` or ``CANCELLED`` and its action is
reconciled; the dispatcher, the reconciler and the cancel gate read only unfinished rows. It is
kept inside the idempotency window of its action (a restored backup brings its own copy back), then
deleted once it finished before the tenant's cut-off.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q

from apps.actions.models import ActionStatus
from apps.core.retention import Purged, delete_batch
from apps.outbox.models import OutboxMessage, OutboxStatus

FINISHED = (OutboxStatus.DELIVERED, OutboxStatus.FAILED, OutboxStatus.CANCELLED)


def purgeable_messages(tenant_id: int, *, before: datetime, keys_before: datetime, task_statuses):
    """Finished outbox rows of ``tenant_id`` that may be deleted, of tasks in one of
    ``task_statuses`` (the finished ones) (a queryset)."""
    finished_before = Q(delivered_at__lt=before) | Q(delivered_at__isnull=True, created_at__lt=before)
    return (OutboxMessage.objects.for_tenant(tenant_id)
            .filter(finished_before, status__in=FINISHED, action__created_at__lt=keys_before,
                    action__task__status__in=list(task_statuses))
            .exclude(action__status__in=(ActionStatus.INTENDED, ActionStatus.UNKNOWN)))


def purge_messages_batch(tenant_id: int, *, before: datetime, keys_before: datetime, task_statuses,
                         limit: int) -> Purged:
    """Delete up to ``limit`` of :func:`purgeable_messages` that nothing holds."""
    return delete_batch(purgeable_messages(tenant_id, before=before, keys_before=keys_before,
                                           task_statuses=task_statuses), limit)
