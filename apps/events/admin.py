from django.contrib import admin

from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot


@admin.register(TaskEvent)
class TaskEventAdmin(admin.ModelAdmin):
    list_display = ("task", "seq", "type", "actor", "lease_generation", "occurred_at")
    list_filter = ("type",)
    search_fields = ("task__id",)

    def has_change_permission(self, request, obj=None):
        return False  # append-only

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(RefusedEvent)
class RefusedEventAdmin(admin.ModelAdmin):
    list_display = ("task", "at_version", "type", "reason", "recorded_at")


@admin.register(TaskSnapshot)
class TaskSnapshotAdmin(admin.ModelAdmin):
    list_display = ("task", "seq", "reducer_version", "digest", "created_at")
