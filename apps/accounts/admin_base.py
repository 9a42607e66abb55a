"""Django admin foundations: every tenant-bearing model's admin is scoped to the tenants the
signed-in user is a member of, and event-sourced rows are read-only (they change only through
services that append events, so the materialized state always equals the replay of its events)."""

from __future__ import annotations

from django.contrib import admin

from apps.accounts.models import Membership


def admin_tenant_ids(request):
    """Tenant ids the admin user may see, or None for a platform superuser — a superuser who has
    never been a member of any tenant. A tenant member whose memberships were all deactivated
    sees nothing: revoking access never widens it."""
    rows = list(Membership.objects.filter(user_id=request.user.pk).values_list("tenant_id", "is_active"))
    if not rows and request.user.is_superuser:
        return None
    return [tenant_id for tenant_id, active in rows if active]


class TenantScopedAdmin(admin.ModelAdmin):
    """``tenant_path`` is the ORM path from the model to its tenant's id (``tenant_id``,
    ``task__tenant_id``, ``pk`` for the Tenant model itself)."""

    tenant_path = "tenant_id"

    def get_list_filter(self, request):
        """A ``tenant`` filter lists only the tenants present in this admin's (scoped) rows."""
        return [(f, admin.RelatedOnlyFieldListFilter) if f == "tenant" else f
                for f in super().get_list_filter(request)]

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        ids = admin_tenant_ids(request)
        return qs if ids is None else qs.filter(**{f"{self.tenant_path}__in": ids})

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        """Add and change forms offer only the admin's own tenants, and only users who belong to
        them (or to no tenant yet): nothing of another tenant can be picked or even seen."""
        ids = admin_tenant_ids(request)
        if ids is not None:
            from django.contrib.auth import get_user_model
            from django.db.models import Q

            from apps.accounts.models import Tenant

            if db_field.related_model is Tenant:
                kwargs["queryset"] = Tenant.objects.filter(pk__in=ids)
            elif db_field.related_model is get_user_model():
                kwargs["queryset"] = get_user_model().objects.filter(
                    Q(memberships__tenant_id__in=ids) | Q(memberships__isnull=True)).distinct()
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        """Refuse a row that would belong to a tenant the admin is not a member of."""
        ids = admin_tenant_ids(request)
        tenant_id = getattr(obj, "tenant_id", None)
        if ids is not None and tenant_id is not None and tenant_id not in ids:
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied("not a tenant you administer")
        super().save_model(request, obj, form, change)


class ReadOnlyTenantAdmin(TenantScopedAdmin):
    """View-only: rows written by services with their events (tasks, events, actions, approvals,
    outbox, receipts, chunks)."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
