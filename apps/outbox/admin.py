from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.outbox.models import OutboxMessage


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyTenantAdmin):
    list_display = ("id", "tenant", "status", "attempts", "lease_generation", "available_at", "delivered_at")
    list_filter = ("status",)
