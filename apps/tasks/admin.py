from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.tasks.models import Task


@admin.register(Task)
class TaskAdmin(ReadOnlyTenantAdmin):
    list_display = ("id", "tenant", "status", "version", "device", "requester", "lease_generation", "created_at")
    list_filter = ("tenant", "status")
    search_fields = ("id", "symptom")
