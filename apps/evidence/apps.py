from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class EvidenceConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.evidence"
    verbose_name = _("Evidence")
    label = "evidence"
