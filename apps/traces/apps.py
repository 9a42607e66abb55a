from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class TracesConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.traces"
    verbose_name = _("Traces")
    label = "traces"
