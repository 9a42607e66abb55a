from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.tasks.models import Task, TenantUsage


@admin.register(Task)
class TaskAdmin(ReadOnlyTenantAdmin):
    list_display = ("id", "tenant", "status", "version", "device", "requester", "lease_generation", "created_at")
    list_filter = ("tenant", "status")
    search_fields = ("id", "symptom")


@admin.register(TenantUsage)
class TenantUsageAdmin(ReadOnlyTenantAdmin):
    """A tenant's daily ledger (cost units and model tokens, used and reserved): read-only, it
    moves only with its tasks' events. The quotas themselves are on the tenant's page."""

    list_display = ("day", "tenant", "money_used", "money_reserved", "tokens_used", "tokens_reserved")
    list_filter = ("tenant",)
    date_hierarchy = "day"
