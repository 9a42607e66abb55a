from django.contrib import admin

from apps.outbox.models import OutboxMessage


@admin.register(OutboxMessage)
class OutboxMessageAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "status", "attempts", "lease_generation", "available_at", "delivered_at")
    list_filter = ("status",)
