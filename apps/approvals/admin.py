from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin, TenantScopedAdmin
from apps.approvals.models import ApprovalPolicy, ApprovalRequest


@admin.register(ApprovalPolicy)
class ApprovalPolicyAdmin(TenantScopedAdmin):
    """Policies are versioned (V_p): add a new version instead of editing one in place."""

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # approvals name their V_p: a version is never removed or reused

    list_display = ("tenant", "version", "active", "created_at")


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(ReadOnlyTenantAdmin):
    list_display = ("id", "tenant", "tool", "status", "object_version", "expires_at", "decided_by")
    list_filter = ("tenant", "status", "tool")
    readonly_fields = ("action_digest", "params", "object_version", "policy_version")
