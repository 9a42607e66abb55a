"""Transactional outbox rows (DESIGN.md §6; spec table 16.2 "发件箱": message id, action id, order,
send status — written in the same transaction as the action intent)."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class OutboxStatus(models.TextChoices):
    PENDING = "PENDING", _("Pending")
    IN_FLIGHT = "IN_FLIGHT", _("In flight")
    DELIVERED = "DELIVERED", _("Delivered")
    UNKNOWN = "UNKNOWN", _("Outcome unknown")
    FAILED = "FAILED", _("Failed")
    CANCELLED = "CANCELLED", _("Cancelled before send")


class OutboxMessage(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="+")
    action = models.OneToOneField("actions.Action", on_delete=models.PROTECT, related_name="outbox")
    ordering_key = models.CharField(max_length=200, help_text="messages with one key are sent in order")
    status = models.CharField(max_length=16, choices=OutboxStatus.choices, default=OutboxStatus.PENDING)
    available_at = models.DateTimeField()
    attempts = models.PositiveIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - NULL = unleased
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_generation = models.PositiveIntegerField(default=0, help_text="fencing token sent with the request")
    last_error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        ordering = ["created_at"]
        indexes = [
            models.Index(fields=["status", "available_at"], name="outbox_status_available_idx"),
            # The claim (apps.outbox.dispatch): its due rows oldest first, and for each one whether an
            # older row of its ordering key is still open — probes of the open rows alone, so the claim
            # costs the same on a table of millions of delivered rows, and with no statistics yet
            # (a hash anti-join over every row, or a nested loop over them, is what the planner chose).
            models.Index(fields=["created_at"], name="outbox_due_created_idx",
                         condition=models.Q(status__in=["PENDING", "IN_FLIGHT"])),
            models.Index(fields=["ordering_key", "created_at"], name="outbox_open_ordering_idx",
                         condition=models.Q(status__in=["PENDING", "IN_FLIGHT", "UNKNOWN"])),
        ]

    def __str__(self) -> str:
        return f"outbox {self.id} {self.status}"
