"""Retention of notifications (DESIGN.md §13 "Retention"; ADR 0019).

A notification's ``context`` is the data its words are composed from; some of it is free text a
person or the agent wrote: the agent's ``questions``, a termination ``reason``'s details (a
cancel's words, a failure's), an approver's ``approver_reason``. Once the row is *finished* — its
e-mail ``SENT``, ``DIGESTED``, ``SKIPPED`` (page only) or ``FAILED`` — and it finished before the
tenant's cut-off (``notifications_days``; its ``sent_at``, else its ``created_at``), that text is
emptied and ``purged_at`` set. What a page line needs stays (kind, asset tag, ticket, status, the
reason's leading code, the approval's id), so the bell and the notifications page still read.
A notification about a task still open is left: the requester may still be answering it. Rows
waiting to be sent (``HELD``, ``PENDING``, ``SENDING``) are never touched.
"""

from __future__ import annotations

import re
from datetime import datetime

from django.db import transaction
from django.db.models import Q

from apps.core.retention import Purged, column_sizes
from apps.notifications.models import DeliveryStatus, Notification

FINISHED = (DeliveryStatus.SENT, DeliveryStatus.DIGESTED, DeliveryStatus.SKIPPED, DeliveryStatus.FAILED)
_CODE = re.compile(r"[a-z_]+")


def purged_context(context: dict) -> dict:
    """``context`` without its free text (pure): ``questions`` → ``[]``, ``approver_reason`` →
    ``""``, ``reason`` → its leading reason code only (``"cancelled: fixed itself"`` →
    ``"cancelled"``), and the same for each digest item under ``items``."""
    out = dict(context or {})
    if "questions" in out:
        out["questions"] = []
    if "approver_reason" in out:
        out["approver_reason"] = ""
    if isinstance(out.get("reason"), str):
        code = _CODE.match(out["reason"])
        out["reason"] = code.group(0) if code else ""
    if isinstance(out.get("items"), list):
        out["items"] = [purged_context(i) if isinstance(i, dict) else i for i in out["items"]]
    return out


def purgeable_notifications(tenant_id: int, *, before: datetime, task_statuses):
    """Notifications of ``tenant_id`` whose text may be purged now: finished before ``before``,
    not purged yet, of no task (a digest) or of a task in one of ``task_statuses`` (the finished
    ones) (a queryset, not locked)."""
    finished_before = Q(sent_at__lt=before) | Q(sent_at__isnull=True, created_at__lt=before)
    return (Notification.objects.for_tenant(tenant_id)
            .filter(finished_before, status__in=FINISHED, purged_at__isnull=True)
            .filter(Q(task__isnull=True) | Q(task__status__in=list(task_statuses))))


def purge_notifications_batch(tenant_id: int, *, before: datetime, task_statuses, limit: int,
                              at: datetime) -> Purged:
    """Empty the free text of up to ``limit`` of :func:`purgeable_notifications` that nothing
    holds (``FOR UPDATE SKIP LOCKED``), in one transaction, stamping ``purged_at = at``. Returns
    the rows changed and the bytes of ``context`` freed."""
    table = Notification._meta.db_table
    with transaction.atomic():
        rows = list(purgeable_notifications(tenant_id, before=before, task_statuses=task_statuses)
                    .select_for_update(skip_locked=True, of=("self",)).order_by("pk").only("id", "context")[:limit])
        if not rows:
            return Purged()
        ids = [n.pk for n in rows]
        sizes = column_sizes(table, "context", ids)
        for n in rows:
            n.context, n.purged_at = purged_context(n.context), at
        Notification.objects.bulk_update(rows, ["context", "purged_at"])
        after = column_sizes(table, "context", ids)
        return Purged(len(rows), sum(sizes.values()) - sum(after.values()))
