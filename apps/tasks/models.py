"""The task aggregate (DESIGN.md §4, §5, §8; spec table 16.2 "任务": tenant, task id, state
version, deadline, budget, artifact bundle; tenant + task id unique).

``status``, ``state`` and the budget columns are the materialized state: they always equal the
replay of the task's events. ``version`` equals the seq of the last event. ``lease_*`` fields are
ownership metadata (not part of the replayed state): a worker holds the lease with fencing token
``lease_generation`` and every commit checks it.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager
from apps.tasks import reducer


class Urgency(models.TextChoices):
    LOW = "low", _("Low")
    NORMAL = "normal", _("Normal")
    HIGH = "high", _("High")
    CRITICAL = "critical", _("Critical")


#: a task status as the people reading a page call it, in their language
STATUS_LABELS = {
    reducer.ACCEPTED: _("Accepted"),
    reducer.RETRIEVING: _("Finding evidence"),
    reducer.PROPOSING: _("Drafting"),
    reducer.VALIDATING: _("Checking"),
    reducer.WAITING_INPUT: _("Waiting for your answer"),
    reducer.WAITING_APPROVAL: _("Waiting for approval"),
    reducer.DISPATCHING: _("Sending"),
    reducer.WAITING_RECONCILIATION: _("Confirming with the ticket system"),
    reducer.COMPLETED: _("Completed"),
    reducer.FAILED: _("Failed"),
    reducer.CANCELLED: _("Cancelled"),
    reducer.COMPENSATING: _("Undoing after cancel"),
    reducer.WAITING_COMPENSATION: _("Waiting for an admin to settle the undo"),
}


#: the codes a task's termination reason starts with (apps/tasks/reducer), as a reader calls them
REASON_LABELS = {
    "ticket_created": _("ticket created"),
    "ticket_commented": _("comment added to the open ticket"),
    "proposal_rejected": _("the proposal was rejected"),
    "no_action_needed": _("no action needed"),
    "deadline_exceeded": _("deadline exceeded"),
    "dispatch_failed": _("sending failed"),
    "cancelled": _("cancelled"),
    "budget_exhausted": _("budget exhausted"),
    "redraft_limit": _("too many re-drafts"),
    "model_error": _("the model failed"),
    "model_output_invalid": _("the model's output could not be used"),
}


def reason_in_words(reason: str) -> str:
    """A recorded termination reason with its leading code (:data:`REASON_LABELS`) named in the
    reader's language and the recorded rest kept as written (``"dispatch_failed: 503"`` → ``"sending
    failed: 503"``); any other text as it is."""
    import re

    m = re.match(r"([a-z_]+)(.*)\Z", reason or "", re.S)
    if m is None or m.group(1) not in REASON_LABELS:
        return reason or ""
    return f"{REASON_LABELS[m.group(1)]}{m.group(2)}"


class Task(models.Model):
    STATUS_CHOICES = [(s, STATUS_LABELS[s]) for s in reducer.ALL_STATUSES]

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="tasks")
    requester = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="tasks")
    device = models.ForeignKey("devices.Device", on_delete=models.PROTECT, related_name="tasks")
    symptom = models.TextField()
    urgency = models.CharField(max_length=16, choices=Urgency.choices, default=Urgency.NORMAL)

    status = models.CharField(max_length=32, choices=STATUS_CHOICES, default=reducer.ACCEPTED)
    version = models.PositiveIntegerField(default=0)
    state = models.JSONField(default=reducer.initial_state)
    termination_reason = models.CharField(max_length=300, blank=True)

    deadline_at = models.DateTimeField()
    budget_total = models.PositiveIntegerField()
    budget_used = models.PositiveIntegerField(default=0)
    budget_reserved = models.PositiveIntegerField(default=0)
    artifact_bundle = models.JSONField()

    request_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - unique when set
    request_digest = models.CharField(max_length=64)

    lease_owner = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 - NULL = unleased
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_generation = models.PositiveIntegerField(default=0)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Retention (apps.tasks.retention): "" while whole, "excerpts" or "payload" once purged to that
    # level, and when. A purged task replays as "purged" (its event skeleton is checked).
    purged = models.CharField(max_length=16, blank=True, default="", db_default="")
    purged_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("task")
        verbose_name_plural = _("tasks")
        constraints = [
            # An Idempotency-Key is the requester's own: another requester reusing it files
            # another request (and learns nothing of the first).
            models.UniqueConstraint(
                fields=["tenant", "requester", "request_key"],
                condition=models.Q(request_key__isnull=False),
                name="task_requester_request_key_uniq",
            ),
            models.CheckConstraint(
                condition=models.Q(budget_used__lte=models.F("budget_total") - models.F("budget_reserved")),
                name="task_budget_u_plus_r_le_b",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "status"], name="task_tenant_status_idx"),
            models.Index(fields=["status", "lease_expires_at"], name="task_status_lease_idx"),
            # the purge's scan: finished tasks of a tenant not yet purged to the last level, oldest first
            models.Index(fields=["tenant", "updated_at"], name="task_purge_scan_idx",
                         condition=models.Q(status__in=sorted(reducer.TERMINAL)) & ~models.Q(purged="payload")),
        ]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"task {self.id} {self.status} v{self.version}"

    @property
    def is_terminal(self) -> bool:
        return self.status in reducer.TERMINAL

    @property
    def can_cancel(self) -> bool:
        """A cancel is possible: the task is running or waiting — not terminal, and not already
        cancelled and compensating (``COMPENSATING``, ``WAITING_COMPENSATION``)."""
        return self.status in reducer.NON_TERMINAL

    @property
    def outcome_pending(self) -> bool:
        """True while the task's committed action has no recorded outcome yet (intended, in flight
        or unknown) — also after a cancel, until the dispatcher or the reconciler settles it."""
        action = (self.state or {}).get("action")
        return bool(action) and action.get("status") in ("INTENDED", "UNKNOWN")


class TenantUsage(models.Model):
    """A tenant's ledger for one UTC day (runtime-invariants.md §1.2: quotas per
    run *and* per principal, so one tenant cannot exhaust the service).

    Every ``reducer/3`` task event that moves the task's money or token ledger moves this row by
    the same amounts, in the same transaction (:func:`apps.tasks.budget.tenant_ledger_apply`): a
    reservation is admitted only while ``used + reserved`` stays within the tenant's daily quota
    too. A task is charged to the day it was accepted, so its settlement lands where its
    reservation did.
    """

    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="usage_days")
    day = models.DateField()
    money_used = models.BigIntegerField(default=0)
    money_reserved = models.BigIntegerField(default=0)
    tokens_used = models.BigIntegerField(default=0)
    tokens_reserved = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("tenant usage (a day)")
        verbose_name_plural = _("tenant usage")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "day"], name="tenant_usage_day_uniq"),
            models.CheckConstraint(condition=models.Q(money_reserved__gte=0, tokens_reserved__gte=0,
                                                      money_used__gte=0, tokens_used__gte=0),
                                   name="tenant_usage_non_negative"),
        ]
        ordering = ["-day"]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.day}: money {self.money_used}+{self.money_reserved}, " \
               f"tokens {self.tokens_used}+{self.tokens_reserved}"
