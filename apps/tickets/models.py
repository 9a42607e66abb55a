"""Mirror of tickets in external systems (external id + version), DESIGN.md §3 ``tickets``."""

from __future__ import annotations

from django.db import models

from apps.accounts.scoping import TenantScopedManager


class TicketMirror(models.Model):
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="tickets")
    action = models.OneToOneField("actions.Action", on_delete=models.PROTECT, related_name="ticket")
    connector = models.CharField(max_length=32)
    external_id = models.CharField(max_length=100)
    external_version = models.PositiveIntegerField()
    status = models.CharField(max_length=32)
    data = models.JSONField()
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["connector", "external_id"], name="ticket_connector_external_uniq"),
        ]
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return f"{self.connector}:{self.external_id} v{self.external_version}"


class WebhookOutcome(models.TextChoices):
    APPLIED = "APPLIED", "Applied to the ticket mirror"
    STALE = "STALE", "Older than the mirror (out of order): ignored"
    DUPLICATE = "DUPLICATE", "Already received: ignored"
    UNCORRELATED = "UNCORRELATED", "No action of ours: ignored"
    REJECTED = "REJECTED", "Signature missing, wrong or expired: ignored"
    MALFORMED = "MALFORMED", "Signed but unreadable: ignored"


class InboundWebhook(models.Model):
    """Every webhook delivery received from a ticket system, with what was done with it (DESIGN.md
    §11: authenticated, correlated to an action, deduplicated). Only a verified, correlated, new
    and newer event changes anything (the ticket mirror); every other one is kept here and logged."""

    source = models.CharField(max_length=32)
    event_id = models.CharField(max_length=100, blank=True)
    verified = models.BooleanField(default=False)
    outcome = models.CharField(max_length=16, choices=WebhookOutcome.choices)
    reason = models.CharField(max_length=300, blank=True)
    tenant = models.ForeignKey("accounts.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    action = models.ForeignKey("actions.Action", null=True, blank=True, on_delete=models.PROTECT,
                               related_name="webhooks")
    body = models.JSONField(null=True, blank=True)
    raw_excerpt = models.TextField(blank=True, help_text="the first 1,000 characters of an unverified body")
    received_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedManager()

    class Meta:
        constraints = [
            # Deduplication: one verified delivery per event id and source.
            models.UniqueConstraint(fields=["source", "event_id"],
                                    condition=models.Q(verified=True) & ~models.Q(outcome="DUPLICATE"),
                                    name="webhook_verified_event_uniq"),
        ]
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.source} webhook {self.event_id or '?'} {self.outcome}"
