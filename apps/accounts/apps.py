from django.apps import AppConfig
from django.db.models.signals import post_delete, post_migrate, post_save
from django.utils.translation import gettext_lazy as _


class AccountsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "apps.accounts"
    verbose_name = _("Accounts and tenants")
    label = "accounts"

    def ready(self) -> None:
        """Staff status and the tenant-admin group follow memberships; the group's permissions
        are (re)granted after every migrate (apps.accounts.roles). Models load only once the
        registry is ready, hence the imports here."""
        from apps.accounts import language  # noqa: F401 - connects language_at_sign_in
        from apps.accounts.models import Membership
        from apps.accounts.roles import admin_access_sync, tenant_admin_group

        def membership_changed(sender, instance, **kwargs) -> None:
            admin_access_sync(instance.user_id)

        def grant_tenant_admin_permissions(sender, **kwargs) -> None:
            tenant_admin_group()

        post_save.connect(membership_changed, sender=Membership, weak=False, dispatch_uid="accounts.membership_saved")
        post_delete.connect(membership_changed, sender=Membership, weak=False,
                            dispatch_uid="accounts.membership_deleted")
        post_migrate.connect(grant_tenant_admin_permissions, weak=False, dispatch_uid="accounts.tenant_admin_group")
