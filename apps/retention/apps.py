from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class RetentionConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.retention"
    verbose_name = _("Retention")
    label = "retention"
