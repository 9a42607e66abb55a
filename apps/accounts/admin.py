from django.contrib import admin

from apps.accounts.models import Membership, Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "created_at")
    search_fields = ("slug", "name")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "tenant", "role", "scopes", "is_active")
    list_filter = ("tenant", "role", "is_active")
    search_fields = ("user__username",)
