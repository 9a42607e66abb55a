from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin

from apps.accounts.admin_base import TenantScopedAdmin, admin_tenant_ids
from apps.accounts.models import Membership, Tenant


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    tenant_path = "pk"
    list_display = ("slug", "name", "ticket_system", "daily_budget_units", "daily_token_limit", "max_active_tasks",
                    "created_at")
    search_fields = ("slug", "name")

    def has_add_permission(self, request):
        """Only a platform superuser (a member of no tenant) creates tenants."""
        return admin_tenant_ids(request) is None and super().has_add_permission(request)

    def get_readonly_fields(self, request, obj=None):
        """A tenant's quotas protect the whole service: only a platform superuser changes them."""
        fields = tuple(super().get_readonly_fields(request, obj))
        if admin_tenant_ids(request) is not None:
            fields += ("daily_budget_units", "daily_token_limit", "max_active_tasks")
        return fields


@admin.register(Membership)
class MembershipAdmin(TenantScopedAdmin):
    """Memberships of the admin's tenants. Nobody changes or deletes their own membership here:
    another admin of the tenant (or a platform superuser) does."""

    list_display = ("user", "tenant", "role", "scopes", "is_active")
    list_filter = ("tenant", "role", "is_active")
    search_fields = ("user__username",)

    def has_change_permission(self, request, obj=None):
        if obj is not None and obj.user_id == request.user.pk:
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        if obj is not None and obj.user_id == request.user.pk:
            return False
        return super().has_delete_permission(request, obj)


User = get_user_model()
admin.site.unregister(User)


@admin.register(User)
class TenantUserAdmin(UserAdmin):
    """Users who are members of the admin's tenants."""

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        ids = admin_tenant_ids(request)
        return qs if ids is None else qs.filter(memberships__tenant_id__in=ids).distinct()
