"""Retention of attachments (DESIGN.md §13 "Retention"; ADR 0019): a report's files go with its
payload.

Once a finished task's payload is purged (``apps.tasks.retention``, level ``payload``), its files
are purged too: the stored bytes are deleted from the ``attachments`` storage and the row keeps a
marker (``purged_at``) with the digest, type and size — what the ``task.accepted`` event's digest
and an approval's h(a) bound — while ``name`` and ``text`` (a log's fault lines) are emptied. Kept:

- a file with a delivery still open (``PENDING`` or ``IN_FLIGHT``): the sender still needs the bytes;
- the stored bytes, while another attachment row not purged holds the same key (a tenant's file is
  stored once per content, :func:`apps.attachments.services.storage_key`).

A purge holds a transaction-level advisory lock per storage key (:func:`storage_key_lock`) from
the check for other holders to its commit; :func:`apps.attachments.services.attachments_record`
takes the same lock, so a report filing the same bytes meanwhile either commits its row first (the
bytes are kept) or finds them deleted and stores them again.
"""

from __future__ import annotations

from datetime import datetime

from django.core.files.storage import storages
from django.db import transaction
from django.db.models import Exists, OuterRef

from apps.attachments.models import Attachment, AttachmentDelivery, DeliveryStatus
from apps.attachments.services import STORAGE_ALIAS, storage_key_lock
from apps.core.retention import PurgeCounts, Purged, column_sizes

#: the pseudo-table under which a run records the stored files it deleted (rows: files, bytes: their sizes)
STORAGE_TABLE = "storage:attachments"

OPEN_DELIVERY = (DeliveryStatus.PENDING, DeliveryStatus.IN_FLIGHT)


def purgeable_attachments(tenant_id: int, *, task_statuses):
    """Attachments of ``tenant_id`` that may be purged now: not purged yet, of a task in one of
    ``task_statuses`` (the finished ones) whose payload is purged, without an open delivery (a
    queryset, not locked)."""
    open_delivery = AttachmentDelivery.objects.filter(attachment_id=OuterRef("pk"), status__in=OPEN_DELIVERY)
    return (Attachment.objects.for_tenant(tenant_id)
            .filter(purged_at__isnull=True, task__purged="payload", task__status__in=list(task_statuses))
            .exclude(Exists(open_delivery)))


def purge_attachments_batch(tenant_id: int, *, task_statuses, limit: int, at: datetime) -> tuple[int, PurgeCounts]:
    """Purge up to ``limit`` of :func:`purgeable_attachments` that nothing holds, in one
    transaction: lock the rows (``SKIP LOCKED``) and their storage keys, empty ``name`` and ``text``,
    set ``purged_at = at``, and delete each stored file no other unpurged row holds. Returns
    ``(rows purged, counts)``: the table's rows and column bytes, and under :data:`STORAGE_TABLE`
    the files deleted and their bytes. A key lock held elsewhere raises the database's lock
    timeout (the caller skips the batch); a file already gone is not an error."""
    table = Attachment._meta.db_table
    counts = PurgeCounts()
    with transaction.atomic():
        rows = list(purgeable_attachments(tenant_id, task_statuses=task_statuses)
                    .select_for_update(skip_locked=True, of=("self",)).order_by("pk")
                    .values_list("pk", "storage_key", "size")[:limit])
        if not rows:
            return 0, counts
        ids = [pk for pk, _, _ in rows]
        keys = sorted({key for _, key, _ in rows})
        for key in keys:
            storage_key_lock(key)
        held = set(Attachment.objects.filter(storage_key__in=keys, purged_at__isnull=True)
                   .exclude(pk__in=ids).values_list("storage_key", flat=True))
        before = column_sizes(table, "name, text", ids)
        Attachment.objects.filter(pk__in=ids).update(name="", text="", purged_at=at)
        after = column_sizes(table, "name, text", ids)
        counts.add(table, Purged(len(ids), sum(before.values()) - sum(after.values())))
        storage = storages[STORAGE_ALIAS]
        sizes = {key: size for _, key, size in rows}
        freed = Purged()
        for key in keys:
            if key in held:
                continue
            if storage.exists(key):
                storage.delete(key)
                freed.add(Purged(1, sizes[key]))
        if freed.rows:
            counts.add(STORAGE_TABLE, freed)
        return len(ids), counts
