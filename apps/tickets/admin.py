from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.tickets.models import TicketMirror


@admin.register(TicketMirror)
class TicketMirrorAdmin(ReadOnlyTenantAdmin):
    list_display = ("external_id", "connector", "external_version", "status", "tenant", "updated_at")
    list_filter = ("connector", "status")
