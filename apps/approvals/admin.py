from django.contrib import admin

from apps.approvals.models import ApprovalPolicy, ApprovalRequest


@admin.register(ApprovalPolicy)
class ApprovalPolicyAdmin(admin.ModelAdmin):
    list_display = ("tenant", "version", "active", "created_at")


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "tool", "status", "object_version", "expires_at", "decided_by")
    list_filter = ("tenant", "status", "tool")
    readonly_fields = ("action_digest", "params", "object_version", "policy_version")
