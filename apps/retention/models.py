"""Per-tenant retention policy and the record of each purge run (DESIGN.md §13 "Retention")."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager

#: the policy's fields, each a number of days, and the FAULTDESK["RETENTION"] default it falls back to
DAY_FIELDS = ("excerpts_days", "payloads_days", "webhooks_days", "attempts_days", "outbox_days",
              "notifications_days", "gateway_calls_days")

_days = [MinValueValidator(1), MaxValueValidator(36500)]


class RetentionPolicy(models.Model):
    """How long a tenant's finished work keeps what it holds. Each field is days after the thing
    finished (a task's last change, an attempt's end, a row's delivery or receipt); empty means the
    installation's default (``FAULTDESK_RETENTION_*``). Whatever a policy says, nothing an open
    task, an unreconciled action or the idempotency window needs is purged (``apps.retention.purge``)."""

    tenant = models.OneToOneField("accounts.Tenant", on_delete=models.CASCADE, related_name="retention_policy")
    excerpts_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days,
        help_text=_("Evidence excerpts and quotes in a finished task's state and events."))
    payloads_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days,
        help_text=_("Event payloads, snapshots and the report text of a finished task (the event skeleton stays)."))
    webhooks_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days, help_text=_("Inbound webhook rows."))
    attempts_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days, help_text=_("Dispatch attempts of settled actions."))
    outbox_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days, help_text=_("Finished outbox rows."))
    notifications_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days,
        help_text=_("The words of a notification once it was sent (or given up): its questions and reasons."))
    gateway_calls_days = models.PositiveIntegerField(
        null=True, blank=True, validators=_days,
        help_text=_("The records of outbound calls (tool, destination, outcome, time) made for the tenant's work."))
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("retention policy")
        verbose_name_plural = _("retention policies")

    def __str__(self) -> str:
        return f"retention policy of {self.tenant_id}"


class PurgeRun(models.Model):
    """What one run of the purge did for one tenant (``tenant`` empty: rows that belong to no
    tenant): when, whether the run reached the end of what was eligible (``complete``) or stopped
    at its time budget, and per table the rows and bytes it purged. Recorded only for a tenant the
    run purged something of, or when the run stopped early."""

    tenant = models.ForeignKey("accounts.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    complete = models.BooleanField(default=False)
    dry_run = models.BooleanField(default=False)
    tasks = models.JSONField(default=dict, help_text="tasks purged per level")
    tables = models.JSONField(default=dict, help_text="table -> {rows, bytes}")
    skipped = models.JSONField(default=dict, help_text="batches given up (a lock timeout) per step")

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("purge run")
        verbose_name_plural = _("purge runs")
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"purge run {self.started_at:%Y-%m-%d %H:%M:%S}"

