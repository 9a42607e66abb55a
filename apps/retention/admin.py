from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin, TenantScopedAdmin
from apps.retention.models import PurgeRun, RetentionPolicy


@admin.register(RetentionPolicy)
class RetentionPolicyAdmin(TenantScopedAdmin):
    """A tenant's retention policy (apps/retention/purge.py): a tenant admin edits their own
    tenant's; an empty field is the installation's default."""

    list_display = ("tenant", "excerpts_days", "payloads_days", "webhooks_days", "attempts_days", "outbox_days",
                    "notifications_days", "gateway_calls_days", "updated_at")


@admin.register(PurgeRun)
class PurgeRunAdmin(ReadOnlyTenantAdmin):
    """What each purge run did for a tenant: read only."""

    list_display = ("started_at", "finished_at", "tenant", "complete", "tasks", "skipped")
    list_filter = ("complete",)
