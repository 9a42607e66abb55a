from django.contrib import admin

from apps.tickets.models import TicketMirror


@admin.register(TicketMirror)
class TicketMirrorAdmin(admin.ModelAdmin):
    list_display = ("external_id", "connector", "external_version", "status", "tenant", "updated_at")
    list_filter = ("connector", "status")
