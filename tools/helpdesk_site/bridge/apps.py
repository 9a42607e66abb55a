from django.apps import AppConfig


class FaultdeskBridgeConfig(AppConfig):
    name = "tools.helpdesk_site.bridge"
    label = "faultdesk_bridge"
    default_auto_field = "django.db.models.AutoField"
