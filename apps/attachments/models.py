"""Files attached to fault reports, and their delivery to the ticket system (issue: a requester
attaches a photo of the panel or a log; the approver and admin see it; the ticket gets it).

An :class:`Attachment` is recorded with its task, in the transaction that files the report; its
digest is part of the ``task.accepted`` event. Its bytes live in the ``attachments`` storage
(Django's storage API: the file system by default, S3-compatible storage by setting), stored under
their tenant and digest, so a file stored twice is stored once. An :class:`AttachmentDelivery` is an
outbox row: the sending of one attachment to one ticket, written in the transaction that records the
ticket's receipt, sent after it commits, retried until the ticket system has it.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class Attachment(models.Model):
    """One file of a fault report: ``name`` as the requester sent it (checked: no path),
    ``content_type`` and ``kind`` from its content, ``size`` in bytes, ``sha256`` (hex) of its bytes,
    ``storage_key`` in the ``attachments`` storage, and ``text`` (a log's lines that read like
    faults, at most 1,000 characters; empty for pictures and PDF)."""

    class Kind(models.TextChoices):
        IMAGE = "image", _("Picture")
        TEXT = "text", _("Text log")
        PDF = "pdf", _("PDF document")

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="+")
    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="attachments")
    position = models.PositiveSmallIntegerField(help_text="the order in which the requester attached it")
    name = models.CharField(max_length=200)
    content_type = models.CharField(max_length=100)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    storage_key = models.CharField(max_length=300)
    text = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Retention (apps.attachments.retention): set when the task's payload was purged and this file went
    # with it — the stored bytes deleted (unless another unpurged row holds the same bytes), ``name``
    # and ``text`` emptied; the digest, type and size stay.
    purged_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("attachment")
        verbose_name_plural = _("attachments")
        ordering = ["task", "position"]
        constraints = [
            models.UniqueConstraint(fields=["task", "position"], name="attachment_task_position_uniq"),
            models.UniqueConstraint(fields=["task", "sha256"], name="attachment_task_sha256_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.content_type}, {self.size} bytes, sha256 {self.sha256[:12]}…)"

    def as_metadata(self) -> dict:
        """``{"name", "content_type", "size", "sha256"}``: what a ticket's parameters carry of it."""
        return {"name": self.name, "content_type": self.content_type, "size": self.size, "sha256": self.sha256}


class DeliveryStatus(models.TextChoices):
    PENDING = "PENDING", _("Waiting to be sent")
    IN_FLIGHT = "IN_FLIGHT", _("Being sent")
    DELIVERED = "DELIVERED", _("With the ticket")
    FAILED = "FAILED", _("Could not be sent")


class AttachmentDelivery(models.Model):
    """The sending of ``attachment`` to ticket ``ticket_id`` at ticket system ``connector``: an outbox
    row (PENDING → IN_FLIGHT under a lease with fencing token ``lease_generation`` → DELIVERED, or
    FAILED after a refusal or ``ATTACHMENT_DELIVERY_MAX_ATTEMPTS`` attempts). ``remote_id`` is the
    ticket system's record of it."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="+")
    attachment = models.ForeignKey(Attachment, on_delete=models.CASCADE, related_name="deliveries")
    connector = models.CharField(max_length=32)
    ticket_id = models.CharField(max_length=100)
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    available_at = models.DateTimeField()
    attempts = models.PositiveIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_generation = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=500, blank=True)
    remote_id = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("attachment delivery")
        verbose_name_plural = _("attachment deliveries")
        ordering = ["created_at"]
        constraints = [
            models.UniqueConstraint(fields=["attachment", "connector", "ticket_id"],
                                    name="attachment_delivery_once_per_ticket"),
        ]
        indexes = [
            models.Index(fields=["available_at"], name="attachment_delivery_due_idx",
                         condition=models.Q(status__in=["PENDING", "IN_FLIGHT"])),
        ]

    def __str__(self) -> str:
        return f"{self.attachment_id} → {self.connector} {self.ticket_id}: {self.status}"
