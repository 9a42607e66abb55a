from django.apps import AppConfig


class ActionsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.actions"
    label = "actions"

    def ready(self) -> None:
        from apps.actions import checks  # noqa: F401 - registers the key retention check
