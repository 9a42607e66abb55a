from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ActionsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.actions"
    verbose_name = _("Actions")
    label = "actions"

    def ready(self) -> None:
        from apps.actions import checks  # noqa: F401 - registers the key retention check
