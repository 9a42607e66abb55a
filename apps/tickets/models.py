"""Mirror of tickets in external systems (external id + version), DESIGN.md §3 ``tickets``."""

from __future__ import annotations

from datetime import time

from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager
from apps.tickets.sla import DEFAULT_TARGETS, Calendar, Policy, SlaConfigError, check_targets


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
        verbose_name = _("ticket mirror")
        verbose_name_plural = _("ticket mirrors")
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
        verbose_name = _("inbound webhook")
        verbose_name_plural = _("inbound webhooks")
        constraints = [
            # Deduplication: one verified delivery per event id and source.
            models.UniqueConstraint(fields=["source", "event_id"],
                                    condition=models.Q(verified=True) & ~models.Q(outcome="DUPLICATE"),
                                    name="webhook_verified_event_uniq"),
        ]
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.source} webhook {self.event_id or '?'} {self.outcome}"


def _default_workdays() -> list[int]:
    return [0, 1, 2, 3, 4]


def _default_targets() -> dict:
    return {p: dict(t) for p, t in DEFAULT_TARGETS.items()}


class SlaPolicy(models.Model):
    """A tenant's service levels (apps/tickets/sla.py): business hours — ``workdays`` (Monday = 0),
    ``day_start``–``day_end`` in ``timezone``, minus ``holidays`` — and ``targets``, minutes to
    respond and to resolve by priority, each counted in business hours or around the clock."""

    tenant = models.OneToOneField("accounts.Tenant", on_delete=models.CASCADE, related_name="sla_policy")
    timezone = models.CharField(max_length=64, default="UTC", help_text=_("An IANA time zone, e.g. Asia/Shanghai."))
    workdays = ArrayField(models.PositiveSmallIntegerField(), default=_default_workdays,
                          help_text=_("Working days, Monday = 0 … Sunday = 6."))
    day_start = models.TimeField(default=time(9, 0))
    day_end = models.TimeField(default=time(18, 0))
    holidays = ArrayField(models.DateField(), default=list, blank=True,
                          help_text=_("Dates (local) that are not worked, e.g. 2027-02-17."))
    targets = models.JSONField(default=_default_targets,
                               help_text=_("Minutes to respond and to resolve by priority, and whether the clock "
                                           "runs around the clock."))
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("SLA policy")
        verbose_name_plural = _("SLA policies")

    def __str__(self) -> str:
        return f"SLA of {self.tenant}"

    def policy(self):
        """This row as an :class:`apps.tickets.sla.Policy`; ``SlaConfigError`` when it is unusable."""
        return Policy(calendar=Calendar(timezone=self.timezone, workdays=tuple(self.workdays),
                                        day_start=self.day_start, day_end=self.day_end,
                                        holidays=frozenset(self.holidays or ())),
                      targets=check_targets(self.targets))

    def clean(self) -> None:
        """A form's check: the calendar has working time, the targets are well formed, and every
        target gives a date (a 09:00–09:01 working day cannot hold a year's minutes)."""
        try:
            policy = self.policy()
            policy.calendar.check()
            for priority in policy.targets:
                policy.deadlines(timezone.now(), priority)
        except SlaConfigError as exc:
            raise ValidationError(str(exc)) from exc
