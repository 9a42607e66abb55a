from django.contrib import admin

from apps.tasks.models import Task


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "status", "version", "device", "requester", "lease_generation", "created_at")
    list_filter = ("tenant", "status")
    search_fields = ("id", "symptom")
    readonly_fields = ("status", "version", "state", "lease_owner", "lease_expires_at", "lease_generation")
