from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ApprovalsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.approvals"
    verbose_name = _("Approvals")
    label = "approvals"

    def ready(self) -> None:
        """Keep pending approvals in step with their task (a projection run in each task event's
        transaction: :mod:`apps.approvals.projections`), and their respond-by dates in step with
        their tenant's service levels when the policy changes."""
        from django.db.models.signals import post_delete, post_save

        from apps.approvals.projections import pending_approvals_close
        from apps.approvals.services import pending_respond_by_refresh
        from apps.tasks.store import projection_register
        from apps.tickets.models import SlaPolicy

        projection_register(pending_approvals_close)

        def policy_changed(sender, instance, **kwargs) -> None:
            pending_respond_by_refresh(tenant_id=instance.tenant_id)

        post_save.connect(policy_changed, sender=SlaPolicy, weak=False, dispatch_uid="approvals.sla_policy_saved")
        post_delete.connect(policy_changed, sender=SlaPolicy, weak=False, dispatch_uid="approvals.sla_policy_deleted")
