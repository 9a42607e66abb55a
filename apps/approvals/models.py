"""Approval policy and approval requests (DESIGN.md §7; spec §16.6, table 16.2 "审批": action
digest, object version, approver, scope, expiry — never reused for changed parameters or object)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class ApprovalPolicy(models.Model):
    """A tenant's approval policy; ``version`` is V_p. ``rules`` is ``{"risk": {level: rule},
    "tools": {tool: rule}}`` (or an older flat ``{tool: rule}``), a rule being
    ``{"requires_approval": bool, "ttl_minutes": int, "approver_roles": [...]}``; see
    :func:`apps.approvals.services.policy_rule`. The highest active version applies; a version is
    never edited, a new one is added."""

    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="approval_policies")
    version = models.PositiveIntegerField()
    rules = models.JSONField()
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("approval policy")
        verbose_name_plural = _("approval policies")
        constraints = [models.UniqueConstraint(fields=["tenant", "version"], name="policy_tenant_version_uniq")]
        ordering = ["tenant", "-version"]

    def __str__(self) -> str:
        return f"policy v{self.version} of {self.tenant}"

    def clean(self) -> None:
        """Reject malformed ``rules`` with a field error (the Django admin shows it)."""
        from django.core.exceptions import ValidationError

        from apps.approvals.rules import policy_rules_validate

        problems = policy_rules_validate(self.rules)
        if problems:
            raise ValidationError({"rules": problems})


class ApprovalStatus(models.TextChoices):
    PENDING = "PENDING", _("Pending")
    APPROVED = "APPROVED", _("Approved")
    REJECTED = "REJECTED", _("Rejected")
    EXPIRED = "EXPIRED", _("Expired")
    INVALIDATED = "INVALIDATED", _("Invalidated")


class ApprovalRequest(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="approvals")
    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="approvals")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    tool = models.CharField(max_length=64)
    tool_version = models.CharField(max_length=16)
    params = models.JSONField()
    action_digest = models.CharField(max_length=64, help_text="h(a) the approval binds")
    object_type = models.CharField(max_length=32)
    object_id = models.CharField(max_length=64)
    object_version = models.PositiveIntegerField(help_text="V_o the approval binds")
    policy_version = models.PositiveIntegerField(help_text="V_p the approval was asked under")
    approver_roles = models.JSONField(default=list, blank=True,
                                      help_text="roles that may decide it, as policy V_p said when it was asked")
    scope = models.CharField(max_length=200, help_text="tenant:tool:object the approval covers")
    side_effects = models.TextField()
    evidence = models.JSONField(default=list)
    expires_at = models.DateTimeField()
    status = models.CharField(max_length=16, choices=ApprovalStatus.choices, default=ApprovalStatus.PENDING)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    reason = models.TextField(blank=True)
    #: why the system closed it (invalidated): kept apart from ``reason``, which after a person's
    #: decision stays their words (a pending approval closed has the same text in both)
    closed_reason = models.TextField(blank=True, default="", db_default="")
    created_at = models.DateTimeField(auto_now_add=True)
    respond_by = models.DateTimeField(null=True, blank=True,
                                      help_text="the request's respond-by due date (SLA) when this was asked; "
                                                "the pending queue shows the soonest first")
    # Retention (apps.approvals.retention): "" while whole, "excerpts" or "payload" once its copies of the
    # evidence excerpts (and, at "payload", the free text of its parameters) were emptied, and when. The
    # only change the binding trigger admits to ``params`` and ``evidence`` (migration 0007).
    purged = models.CharField(max_length=16, blank=True, default="", db_default="")
    purged_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("approval request")
        verbose_name_plural = _("approval requests")
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["tenant", "status", "created_at"], name="approval_queue_idx"),
                   models.Index(fields=["tenant", "status", "respond_by"], name="approval_due_idx")]

    def __str__(self) -> str:
        return f"approval {self.id} {self.tool} {self.status}"
