from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class LlmConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.llm"
    verbose_name = _("Models")
    label = "llm"
