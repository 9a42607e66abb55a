"""Django admin foundations: every tenant-bearing model's admin is scoped to the tenants the
signed-in user is a member of, and event-sourced rows are read-only (they change only through
services that append events, so the materialized state always equals the replay of its events)."""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied

from apps.accounts import roles
from apps.accounts.models import Tenant


def admin_tenant_ids(request):
    """Tenant ids the signed-in admin may see and change, or None for a platform admin
    (:func:`apps.accounts.roles.admin_tenant_ids`: only active *admin* memberships count, and
    revoking access never widens it)."""
    return roles.admin_tenant_ids(request.user)


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
        """Add and change forms offer only the admin's own tenants, and only people who may be
        given a role there: never a superuser, and for a tenant admin only non-staff users who
        already belong to one of the admin's tenants (apps.accounts.roles). Nothing of another
        tenant can be picked or even seen."""
        ids = admin_tenant_ids(request)
        if db_field.related_model is Tenant and ids is not None:
            kwargs["queryset"] = Tenant.objects.filter(pk__in=ids)
        elif db_field.related_model is get_user_model():
            users = get_user_model().objects.filter(is_superuser=False)
            if ids is not None:
                users = users.filter(is_staff=False, memberships__tenant_id__in=ids).distinct()
            kwargs["queryset"] = users
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        """Refuse a row that would belong to a tenant the admin is not a member of."""
        ids = admin_tenant_ids(request)
        tenant_id = getattr(obj, "tenant_id", None)
        if ids is not None and tenant_id is not None and tenant_id not in ids:
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
