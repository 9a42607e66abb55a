from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.actions.models import Action, ActionAttempt


class AttemptInline(admin.TabularInline):
    model = ActionAttempt
    extra = 0
    readonly_fields = ("number", "fencing_token", "outcome", "error", "started_at", "finished_at", "worker")


@admin.register(Action)
class ActionAdmin(ReadOnlyTenantAdmin):
    list_display = ("id", "tool", "status", "idempotency_key", "external_id", "tenant", "created_at")
    list_filter = ("tenant", "tool", "status")
    search_fields = ("idempotency_key", "external_id")
    inlines = [AttemptInline]


@admin.register(ActionAttempt)
class ActionAttemptAdmin(ReadOnlyTenantAdmin):
    tenant_path = "action__tenant_id"
    list_display = ("action", "number", "outcome", "fencing_token", "started_at", "finished_at")
    list_filter = ("outcome",)
