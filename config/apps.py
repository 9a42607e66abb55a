from django.apps import AppConfig


class FaultdeskConfig(AppConfig):
    """The project itself, as an app: it registers the deploy system checks."""

    name = "config"
    label = "faultdesk"

    def ready(self) -> None:
        from config import deploy_checks  # noqa: F401 - registers the checks
