from django.contrib import admin

from apps.devices.models import Device


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("asset_tag", "tenant", "kind", "state", "alert_code", "version", "updated_at")
    list_filter = ("tenant", "kind", "state", "criticality")
    search_fields = ("asset_tag", "name", "alert_code")
