"""Tenant-scoped reads of approvals."""

from __future__ import annotations

from django.db.models import QuerySet

from apps.accounts.principal import Principal
from apps.approvals.models import ApprovalRequest


def approval_list(*, principal: Principal, status: str | None = None) -> QuerySet[ApprovalRequest]:
    """Approvals of the principal's tenant (approvers and admins only; others get none)."""
    if not principal.is_approver:
        return ApprovalRequest.objects.none()
    qs = ApprovalRequest.objects.filter(tenant_id=principal.tenant_id).select_related(
        "task", "task__device", "requested_by", "decided_by"
    )
    if status:
        qs = qs.filter(status=status)
    return qs.order_by("-created_at")


def approval_get(*, principal: Principal, approval_id) -> ApprovalRequest | None:
    return approval_list(principal=principal).filter(pk=approval_id).first()
