"""The append-only per-task event log, refused events and snapshots (DESIGN.md §4; spec §16.2
table 16.2 "事件": task, seq, type, payload digest, occurred/recorded time; seq is unique per task
and order is seq, never timestamps)."""

from __future__ import annotations

import uuid

from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager, scoped_manager


class TaskEvent(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="events")
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="+")
    seq = models.PositiveIntegerField()
    type = models.CharField(max_length=64)
    payload = models.JSONField()
    payload_digest = models.CharField(max_length=64)
    occurred_at = models.DateTimeField()
    recorded_at = models.DateTimeField(auto_now_add=True)
    causation_id = models.UUIDField(null=True, blank=True)
    actor = models.CharField(max_length=120)
    lease_generation = models.PositiveIntegerField(null=True, blank=True)
    # Retention (apps.events.retention): "" while the payload is whole; "excerpts" once evidence
    # excerpts were removed from it, "payload" once the whole payload was; type, seq and
    # payload_digest (the digest of the payload as written) always stay.
    purged = models.CharField(max_length=16, blank=True, default="", db_default="")
    purged_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("task event")
        verbose_name_plural = _("task events")
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="taskevent_task_seq_uniq")]
        ordering = ["task", "seq"]

    def __str__(self) -> str:
        return f"{self.task_id}#{self.seq} {self.type}"


class RefusedEvent(models.Model):
    """An event δ refused (illegal or late): recorded for the trace, never applied."""

    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="refused_events")
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="+")
    at_version = models.PositiveIntegerField()
    type = models.CharField(max_length=64)
    payload = models.JSONField()
    reason = models.CharField(max_length=300)
    actor = models.CharField(max_length=120)
    lease_generation = models.PositiveIntegerField(null=True, blank=True)
    recorded_at = models.DateTimeField(auto_now_add=True)
    purged = models.CharField(max_length=16, blank=True, default="", db_default="")

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("refused event")
        verbose_name_plural = _("refused events")
        ordering = ["task", "recorded_at"]

    def __str__(self) -> str:
        return f"{self.task_id}@{self.at_version} refused {self.type}"


class TaskSnapshot(models.Model):
    """State after event ``seq`` (replay may start at ``seq + 1``); ``digest`` guards the state."""

    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="snapshots")
    seq = models.PositiveIntegerField()
    state = models.JSONField()
    digest = models.CharField(max_length=64)
    reducer_version = models.CharField(max_length=32)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = scoped_manager("task__tenant_id")

    class Meta:
        verbose_name = _("task snapshot")
        verbose_name_plural = _("task snapshots")
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="tasksnapshot_task_seq_uniq")]
        ordering = ["task", "-seq"]

    def __str__(self) -> str:
        return f"snapshot {self.task_id}@{self.seq}"
