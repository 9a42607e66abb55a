"""The Django admin of tenants, memberships and users. A tenant admin manages the people of their
own tenants and can never climb: no superuser, staff, group or permission field is offered, no
staff or superuser or member of another tenant can be edited (or have a password reset), a user's
last membership cannot be deleted, and a platform superuser can never be made a member
(apps.accounts.roles)."""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.forms import AdminUserCreationForm
from django.core.exceptions import PermissionDenied
from django.db import transaction

from apps.accounts.admin_base import ReadOnlyTenantAdmin, TenantScopedAdmin, admin_tenant_ids
from apps.accounts.models import LanguagePreference, Membership, Role, Tenant
from apps.accounts.roles import user_editable_by


@admin.register(Tenant)
class TenantAdmin(TenantScopedAdmin):
    tenant_path = "pk"
    list_display = ("slug", "name", "ticket_system", "daily_budget_units", "daily_token_limit", "max_active_tasks",
                    "created_at")
    search_fields = ("slug", "name")

    def has_add_permission(self, request):
        """Only a platform superuser (a member of no tenant) creates tenants."""
        return admin_tenant_ids(request) is None and super().has_add_permission(request)

    def has_delete_permission(self, request, obj=None):
        """Deleting a tenant deletes everything it owns: a platform superuser's decision only."""
        return admin_tenant_ids(request) is None and super().has_delete_permission(request, obj)

    def get_readonly_fields(self, request, obj=None):
        """A tenant's quotas protect the whole service: only a platform superuser changes them."""
        fields = tuple(super().get_readonly_fields(request, obj))
        if admin_tenant_ids(request) is not None:
            # The ticket system is what approvals describe ("creates one ticket in …"): a platform decision.
            fields += ("slug", "ticket_system", "daily_budget_units", "daily_token_limit", "max_active_tasks")
        return fields


def _without_bulk_delete(actions: dict, request) -> dict:
    """A tenant admin deletes one row at a time, through the checks of ``has_delete_permission``
    (the bulk action checks only the model-level permission)."""
    if admin_tenant_ids(request) is not None:
        actions.pop("delete_selected", None)
    return actions


@admin.register(Membership)
class MembershipAdmin(TenantScopedAdmin):
    """Memberships of the admin's tenants. Nobody changes or deletes their own membership here,
    and a tenant admin does not change another admin's (a platform superuser does); a
    membership's user and tenant are fixed once it exists; a user's last membership is
    deactivated, never deleted."""

    list_display = ("user", "tenant", "role", "scopes", "is_active")
    list_filter = ("tenant", "role", "is_active")
    search_fields = ("user__username",)

    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        return fields + ("user", "tenant") if obj is not None else fields

    def _untouchable(self, request, obj) -> bool:
        """Her own membership; and for a tenant admin, a membership of staff (another admin): a
        demotion would drop the staff flag that keeps the account out of her reach, so she could
        then reset its password and promote it back. A platform superuser changes those."""
        if obj.user_id == request.user.pk:
            return True
        return admin_tenant_ids(request) is not None and (obj.user.is_staff or obj.user.is_superuser)

    def has_change_permission(self, request, obj=None):
        if obj is not None and self._untouchable(request, obj):
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        if obj is not None:
            if self._untouchable(request, obj):
                return False
            if not Membership.objects.filter(user_id=obj.user_id).exclude(pk=obj.pk).exists():
                return False  # the last one: deactivate it instead
        return super().has_delete_permission(request, obj)

    def get_actions(self, request):
        return _without_bulk_delete(super().get_actions(request), request)


class UserCreationWithMembershipForm(AdminUserCreationForm):
    """A new user is created together with their first membership, in one transaction: a tenant
    admin never makes a user who belongs to no tenant (and so could never see or manage them)."""

    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(),
                                    help_text="the tenant the new user joins (required for tenant admins)")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.REQUESTER)


User = get_user_model()
admin.site.unregister(User)


@admin.register(User)
class TenantUserAdmin(UserAdmin):
    """Users who are members of the admin's tenants. For a tenant admin the forms hold no
    superuser, staff, group or permission field; staff, superusers and members of other tenants
    are view-only (no edit, no password reset, no delete)."""

    add_form = UserCreationWithMembershipForm
    add_fieldsets = (
        (None, {"classes": ("wide",),
                "fields": ("username", "usable_password", "password1", "password2", "tenant", "role")}),
    )
    tenant_fieldsets = (
        (None, {"fields": ("username", "password")}),
        ("Personal info", {"fields": ("first_name", "last_name", "email")}),
        ("Status", {"fields": ("is_active",)}),
        ("Important dates", {"fields": ("last_login", "date_joined")}),
    )

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        ids = admin_tenant_ids(request)
        return qs if ids is None else qs.filter(memberships__tenant_id__in=ids).distinct()

    def get_fieldsets(self, request, obj=None):
        if obj is not None and admin_tenant_ids(request) is not None:
            return self.tenant_fieldsets
        return super().get_fieldsets(request, obj)

    def get_readonly_fields(self, request, obj=None):
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is not None and admin_tenant_ids(request) is not None:
            fields += ("last_login", "date_joined")
        return fields

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        if obj is None and "tenant" in form.base_fields:
            ids = admin_tenant_ids(request)
            tenant = form.base_fields["tenant"]
            tenant.queryset = Tenant.objects.all() if ids is None else Tenant.objects.filter(pk__in=ids)
            tenant.required = ids is not None
        return form

    def has_change_permission(self, request, obj=None):
        if obj is not None and not user_editable_by(obj, admin_tenant_ids(request)):
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        if obj is not None and (obj.pk == request.user.pk or not user_editable_by(obj, admin_tenant_ids(request))):
            return False
        return super().has_delete_permission(request, obj)

    def get_actions(self, request):
        return _without_bulk_delete(super().get_actions(request), request)

    def save_model(self, request, obj, form, change):
        """A tenant admin's write may not touch a superuser, staff or group flag, nor a user they
        may not edit; a new user joins the chosen tenant in the same transaction."""
        ids = admin_tenant_ids(request)
        if ids is not None:
            if change:
                before = User.objects.get(pk=obj.pk)
                if not user_editable_by(before, ids) or (obj.is_staff, obj.is_superuser) != (
                        before.is_staff, before.is_superuser):
                    raise PermissionDenied("not a user you may change")
            elif obj.is_staff or obj.is_superuser:
                raise PermissionDenied("a tenant admin cannot create staff or superusers")
        with transaction.atomic():
            super().save_model(request, obj, form, change)
            tenant = form.cleaned_data.get("tenant") if not change else None
            if tenant is not None:
                if ids is not None and tenant.pk not in ids:
                    raise PermissionDenied("not a tenant you administer")
                Membership.objects.create(user=obj, tenant=tenant, role=form.cleaned_data["role"])


@admin.register(LanguagePreference)
class LanguagePreferenceAdmin(ReadOnlyTenantAdmin):
    """Each user's chosen language, read-only: people change their own with the chooser on every
    page. A tenant admin sees the users of their tenants only."""

    list_display = ("user", "language", "updated_at")
    list_filter = ("language",)
    search_fields = ("user__username",)
    #: whose rows a tenant admin sees: the users who are members of their tenants
    tenant_path = "user__memberships__tenant_id"

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("user").distinct()
