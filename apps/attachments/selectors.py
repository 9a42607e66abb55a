"""Reading attachments (rows and bytes). The caller decides who may: a task's attachments are
shown to whoever may see the task (its requester, the tenant's approvers and admins), which the
views check with the task's own selector first."""

from __future__ import annotations

import uuid

from django.core.files.storage import storages

from apps.attachments.models import Attachment, AttachmentDelivery
from apps.attachments.services import STORAGE_ALIAS


def task_attachments(*, tenant_id: int, task_id: uuid.UUID) -> list[Attachment]:
    """The attachments of the tenant's task ``task_id``, in the order attached, each with its
    ``deliveries`` prefetched."""
    return list(Attachment.objects.for_tenant(tenant_id).filter(task_id=task_id)
                .prefetch_related("deliveries").order_by("position"))


def attachment_of_task(*, tenant_id: int, task_id: uuid.UUID, sha256: str) -> Attachment | None:
    """The tenant's task's attachment with digest ``sha256``, or None."""
    return Attachment.objects.for_tenant(tenant_id).filter(task_id=task_id, sha256=sha256).first()


def attachment_bytes(attachment: Attachment) -> bytes:
    """The stored bytes of ``attachment``. Raises ``FileNotFoundError`` when the storage has lost
    them (the caller reports it; the row keeps its digest)."""
    with storages[STORAGE_ALIAS].open(attachment.storage_key, "rb") as f:
        return f.read()


def attachment_open(attachment: Attachment):
    """A file object over ``attachment``'s stored bytes (the caller closes it). Raises
    ``FileNotFoundError`` when the storage has lost them."""
    return storages[STORAGE_ALIAS].open(attachment.storage_key, "rb")


def deliveries_of_task(*, tenant_id: int, task_id: uuid.UUID) -> list[AttachmentDelivery]:
    """The deliveries of the task's attachments to ticket systems, oldest first."""
    return list(AttachmentDelivery.objects.for_tenant(tenant_id).filter(attachment__task_id=task_id)
                .select_related("attachment").order_by("created_at"))
