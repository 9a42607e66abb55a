from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.gateway.models import GatewayCall


@admin.register(GatewayCall)
class GatewayCallAdmin(ReadOnlyTenantAdmin):
    """The outbound calls, read-only: a tenant's admins see the calls made for their tenant's work;
    calls of no tenant (a lookup of several tenants' tickets in one request) only platform admins."""

    list_display = ("at", "tool", "method", "host", "port", "path", "outcome", "http_status", "bytes_received",
                    "duration_ms", "tenant", "task_id")
    list_filter = ("tool", "outcome")
    search_fields = ("host", "path")
    date_hierarchy = "at"
    list_select_related = ("tenant",)
