from django.contrib import admin

from apps.retention.models import PurgeRun, RetentionPolicy


@admin.register(RetentionPolicy)
class RetentionPolicyAdmin(admin.ModelAdmin):
    list_display = ("tenant", "excerpts_days", "payloads_days", "webhooks_days", "attempts_days", "outbox_days",
                    "updated_at")


@admin.register(PurgeRun)
class PurgeRunAdmin(admin.ModelAdmin):
    list_display = ("started_at", "finished_at", "complete", "tasks", "skipped")
    readonly_fields = ("started_at", "finished_at", "complete", "dry_run", "tasks", "tables", "skipped")

    def has_add_permission(self, request):
        return False
