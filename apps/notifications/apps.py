from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class NotificationsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.notifications"
    verbose_name = _("Notifications")
    label = "notifications"

    def ready(self) -> None:
        """Turn task events into notifications in each event's own transaction (a projection:
        :mod:`apps.notifications.projections`), so a rolled-back event notifies nobody."""
        from apps.notifications.projections import notifications_from_event
        from apps.tasks.store import projection_register

        projection_register(notifications_from_event)
