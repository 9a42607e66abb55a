"""Action identity and attempts (DESIGN.md §6; spec table 16.2 "动作": action id, tool version,
parameter digest, idempotency key, status, receipt; one key per logical action, attempts counted
separately)."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager, scoped_manager


class ActionStatus(models.TextChoices):
    INTENDED = "INTENDED", _("Intended")
    SUCCEEDED = "SUCCEEDED", _("Succeeded")
    FAILED = "FAILED", _("Failed")
    UNKNOWN = "UNKNOWN", _("Outcome unknown")
    NOT_SENT = "NOT_SENT", _("Not sent")


class Action(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="actions")
    task = models.ForeignKey("tasks.Task", on_delete=models.PROTECT, related_name="actions")
    tool = models.CharField(max_length=64)
    tool_version = models.CharField(max_length=16)
    connector = models.CharField(max_length=16, default="reference",
                                 help_text="the ticket system this action is sent to, fixed at intent")
    params = models.JSONField()
    params_digest = models.CharField(max_length=64)
    idempotency_key = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=ActionStatus.choices, default=ActionStatus.INTENDED)
    approval = models.ForeignKey(
        "approvals.ApprovalRequest", null=True, blank=True, on_delete=models.PROTECT, related_name="actions"
    )
    compensates = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="compensations",
        help_text="the action whose effect this one compensates (a saga step, reducer/2), or empty",
    )
    object_version = models.PositiveIntegerField(help_text="V_o the action was authorized against")
    reservation = models.PositiveIntegerField(default=0)
    receipt = models.JSONField(null=True, blank=True)
    external_id = models.CharField(max_length=100, blank=True)
    external_version = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.JSONField(null=True, blank=True)
    # Reconciliation of an unknown outcome (DESIGN.md §6): lookups by key so far, the last one's
    # failure, and when. After ``FAULTDESK["RECONCILE_ESCALATE_AFTER"]`` failed lookups (or for a
    # tool without a result lookup) the action waits for a person on the reconciliation page.
    reconcile_attempts = models.PositiveIntegerField(default=0)
    last_reconcile_error = models.JSONField(null=True, blank=True)
    last_reconciled_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("action")
        verbose_name_plural = _("actions")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "idempotency_key"], name="action_tenant_key_uniq"),
        ]
        indexes = [models.Index(fields=["status", "updated_at"], name="action_status_updated_idx")]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.tool} {self.idempotency_key} {self.status}"


class AttemptOutcome(models.TextChoices):
    IN_FLIGHT = "IN_FLIGHT", _("In flight")
    RECEIPT = "RECEIPT", _("Receipt")
    FAILED = "FAILED", _("Failed")
    RETRYABLE = "RETRYABLE", _("Retryable failure")
    UNKNOWN = "UNKNOWN", _("Unknown")
    SKIPPED = "SKIPPED", _("Not sent")


class ActionAttempt(models.Model):
    """One try at sending an action. Written *before* the request goes out, so a crash mid-call
    leaves an ``IN_FLIGHT`` attempt as evidence; the outbox row's lease then expires and the
    dispatcher re-sends the same request with the same idempotency key (the remote deduplicates)."""

    action = models.ForeignKey(Action, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    fencing_token = models.PositiveIntegerField()
    outcome = models.CharField(max_length=16, choices=AttemptOutcome.choices, default=AttemptOutcome.IN_FLIGHT)
    error = models.JSONField(null=True, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=200)

    objects = scoped_manager("action__tenant_id")

    class Meta:
        verbose_name = _("action attempt")
        verbose_name_plural = _("action attempts")
        constraints = [models.UniqueConstraint(fields=["action", "number"], name="attempt_action_number_uniq")]
        ordering = ["action", "number"]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.action_id}: {self.outcome}"
