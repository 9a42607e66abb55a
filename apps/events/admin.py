from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyTenantAdmin):
    list_display = ("task", "seq", "type", "actor", "lease_generation", "occurred_at")
    list_filter = ("type",)
    search_fields = ("task__id",)


@admin.register(RefusedEvent)
class RefusedEventAdmin(ReadOnlyTenantAdmin):
    list_display = ("task", "at_version", "type", "reason", "recorded_at")


@admin.register(TaskSnapshot)
class TaskSnapshotAdmin(ReadOnlyTenantAdmin):
    tenant_path = "task__tenant_id"
    list_display = ("task", "seq", "reducer_version", "digest", "created_at")
