"""Django admin foundations: every tenant-bearing model's admin is scoped to the tenants the
signed-in user is a member of, and event-sourced rows are read-only (they change only through
services that append events, so the materialized state always equals the replay of its events)."""

from __future__ import annotations

from django.contrib import admin

from apps.accounts.models import Membership


def admin_tenant_ids(request):
    """Tenant ids the admin user may see, or None for a platform superuser with no membership."""
    ids = list(Membership.objects.filter(user_id=request.user.pk, is_active=True).values_list("tenant_id", flat=True))
    if not ids and request.user.is_superuser:
        return None
    return ids


class TenantScopedAdmin(admin.ModelAdmin):
    """``tenant_path`` is the ORM path from the model to its tenant's id (``tenant_id``,
    ``task__tenant_id``, ``pk`` for the Tenant model itself)."""

    tenant_path = "tenant_id"

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        ids = admin_tenant_ids(request)
        return qs if ids is None else qs.filter(**{f"{self.tenant_path}__in": ids})


class ReadOnlyTenantAdmin(TenantScopedAdmin):
    """View-only: rows written by services with their events (tasks, events, actions, approvals,
    outbox, receipts, chunks)."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
