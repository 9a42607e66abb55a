from django.contrib import admin

from apps.accounts.admin_base import TenantScopedAdmin
from apps.devices.models import Device
from apps.devices.services import device_update_state


@admin.register(Device)
class DeviceAdmin(TenantScopedAdmin):
    """Edits go through ``device_update_state`` so every change bumps the object version."""

    list_display = ("asset_tag", "tenant", "kind", "state", "alert_code", "version", "updated_at")
    list_filter = ("tenant", "kind", "state", "criticality")
    search_fields = ("asset_tag", "name", "alert_code")
    readonly_fields = ("version", "tenant", "asset_tag")

    def get_readonly_fields(self, request, obj=None):
        return self.readonly_fields if obj else ("version",)

    def save_model(self, request, obj, form, change):
        if not change:
            super().save_model(request, obj, form, change)
            return
        changes = {f: form.cleaned_data[f] for f in form.changed_data if f not in self.readonly_fields}
        if changes:
            device_update_state(device=Device.objects.get(pk=obj.pk), **changes)
