from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ApprovalsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.approvals"
    verbose_name = _("Approvals")
    label = "approvals"

    def ready(self) -> None:
        """Keep pending approvals in step with their task (a projection run in each task event's
        transaction: :mod:`apps.approvals.projections`)."""
        from apps.approvals.projections import pending_approvals_close
        from apps.tasks.store import projection_register

        projection_register(pending_approvals_close)
