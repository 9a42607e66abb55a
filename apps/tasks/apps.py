from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class TasksConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.tasks"
    verbose_name = _("Tasks")
    label = "tasks"

    def ready(self) -> None:
        """Send a report's attachments to its ticket once the write's receipt is recorded (a
        projection run in that event's transaction: :mod:`apps.attachments.delivery`)."""
        from apps.attachments.delivery import deliveries_on_receipt
        from apps.tasks.store import projection_register

        projection_register(deliveries_on_receipt)
