from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.notifications.models import Notification


@admin.register(Notification)
class NotificationAdmin(ReadOnlyTenantAdmin):
    """Read-only: notifications are written by the projection and the sender, never by hand."""

    list_display = ("created_at", "tenant", "recipient", "kind", "status", "attempts", "sent_at", "read_at")
    list_filter = ("kind", "status")
    list_select_related = ("tenant", "recipient")
    search_fields = ("message_id",)
    readonly_fields = ("message_id", "lease_generation", "last_error")
