from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class OutboxConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.outbox"
    verbose_name = _("Outbox")
    label = "outbox"
