"""Retention of dispatch attempts (DESIGN.md §13 "Retention").

An attempt row (number, fencing token, outcome, error, worker) explains one send of an action. It
is kept while its action is unreconciled (``INTENDED``, ``UNKNOWN``) and while the action is inside
the idempotency window; after that, and once the attempt finished before the tenant's cut-off, it
may go. The action row itself — key, parameter digest, receipt — is never deleted.
"""

from __future__ import annotations

from datetime import datetime

from apps.actions.models import ActionAttempt, ActionStatus
from apps.core.retention import Purged, delete_batch

UNRECONCILED = (ActionStatus.INTENDED, ActionStatus.UNKNOWN)


def purgeable_attempts(tenant_id: int, *, before: datetime, keys_before: datetime, task_statuses):
    """Attempts of ``tenant_id`` that may be deleted: finished before ``before``, of an action that
    is reconciled and was created before ``keys_before``, of a task in one of ``task_statuses``
    (the finished ones: an open task — a compensation waiting for a person — keeps its record)."""
    return (ActionAttempt.objects.for_tenant(tenant_id)
            .filter(finished_at__lt=before, action__created_at__lt=keys_before,
                    action__task__status__in=list(task_statuses))
            .exclude(action__status__in=UNRECONCILED))


def purge_attempts_batch(tenant_id: int, *, before: datetime, keys_before: datetime, task_statuses,
                         limit: int) -> Purged:
    """Delete up to ``limit`` of :func:`purgeable_attempts` that nothing holds. Returns
    :class:`~apps.core.retention.Purged`."""
    return delete_batch(purgeable_attempts(tenant_id, before=before, keys_before=keys_before,
                                           task_statuses=task_statuses), limit)
