"""Who may administer what, and why nobody climbs (spec §16.1: identity and permissions come from
the program; DESIGN.md §12 "no data crosses tenants").

Two kinds of administrator, never confused:

* a **platform admin** is a Django superuser and a member of no tenant. Only ``createsuperuser``
  (or another platform admin) makes one; :class:`~apps.accounts.models.Membership` refuses a
  superuser, so a platform admin can never be pulled into a tenant;
* a **tenant admin** is a user with an active ``admin`` membership. Such a user is Django *staff*
  (the admin site's door) in the :data:`TENANT_ADMIN_GROUP` group, whose permissions are
  :data:`TENANT_ADMIN_PERMISSIONS` — never a superuser. ``is_staff`` and the group follow the
  user's memberships (:func:`admin_access_sync`), so nobody sets them by hand.

What a tenant admin sees and changes is decided by :func:`admin_tenant_ids` (the tenants where the
user holds an *active admin* membership) and, for people, :func:`user_editable_by`.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model

from apps.accounts.models import Membership, Role

TENANT_ADMIN_GROUP = "Tenant admins"

#: ``"app_label.model": actions`` a tenant admin holds (Django model permissions). Rows written by
#: services with their events (tasks, events, actions, approvals, outbox, evidence) are view-only;
#: ``auth.group`` and ``auth.permission`` are absent, so no tenant admin can grant anything.
TENANT_ADMIN_PERMISSIONS: dict[str, tuple[str, ...]] = {
    "accounts.tenant": ("view", "change"),
    "accounts.membership": ("view", "add", "change", "delete"),
    "accounts.languagepreference": ("view",),
    "tickets.slapolicy": ("view", "add", "change"),
    "retention.retentionpolicy": ("view", "add", "change"),
    "retention.purgerun": ("view",),
    "auth.user": ("view", "add", "change", "delete"),
    "devices.device": ("view", "add", "change"),
    "approvals.approvalpolicy": ("view", "add"),
    "approvals.approvalrequest": ("view",),
    "actions.action": ("view",),
    "actions.actionattempt": ("view",),
    "events.taskevent": ("view",),
    "events.refusedevent": ("view",),
    "events.tasksnapshot": ("view",),
    "evidence.document": ("view",),
    "evidence.documentversion": ("view",),
    "evidence.chunk": ("view",),
    "evidence.termstatistics": ("view",),
    "evidence.termfrequency": ("view",),
    "outbox.outboxmessage": ("view",),
    "attachments.attachment": ("view",),
    "attachments.attachmentdelivery": ("view",),
    "notifications.notification": ("view",),
    "tasks.task": ("view",),
    "tasks.tenantusage": ("view",),
    "tickets.ticketmirror": ("view",),
    "tickets.inboundwebhook": ("view",),
    "gateway.gatewaycall": ("view",),
}


def tenant_admin_group():
    """The :data:`TENANT_ADMIN_GROUP` group holding exactly :data:`TENANT_ADMIN_PERMISSIONS`
    (those whose permission rows exist yet: they are created after each app migrates).
    Idempotent; returns the ``Group``."""
    from django.contrib.auth.models import Group, Permission
    from django.db.models import Q

    group, _ = Group.objects.get_or_create(name=TENANT_ADMIN_GROUP)
    wanted = Q(pk__in=[])
    for label, actions in TENANT_ADMIN_PERMISSIONS.items():
        app_label, model = label.split(".")
        wanted |= Q(content_type__app_label=app_label, content_type__model=model,
                    codename__in=[f"{a}_{model}" for a in actions])
    perms = set(Permission.objects.filter(wanted).values_list("pk", flat=True))
    if set(group.permissions.values_list("pk", flat=True)) != perms:
        group.permissions.set(perms)
    return group


def admin_access_sync(user_id: int) -> None:
    """Make ``is_staff`` and membership of the tenant-admin group follow the user's memberships:
    staff exactly while the user holds an active ``admin`` membership. A superuser (platform
    admin) is left as it is. Called whenever a membership is saved or deleted."""
    user = get_user_model().objects.filter(pk=user_id).first()
    if user is None or user.is_superuser:
        return
    admin = Membership.objects.filter(user_id=user_id, role=Role.ADMIN, is_active=True).exists()
    if user.is_staff != admin:
        get_user_model().objects.filter(pk=user_id).update(is_staff=admin)
    group = tenant_admin_group()
    if admin:
        user.groups.add(group)
    else:
        user.groups.remove(group)


def is_platform_admin(user) -> bool:
    """An active superuser who is a member of no tenant (see the module docstring)."""
    return bool(user.is_active and user.is_superuser
                and not Membership.objects.filter(user_id=user.pk).exists())


def admin_tenant_ids(user) -> list[int] | None:
    """Tenant ids whose rows ``user`` may see and change in the Django admin: ``None`` (every
    tenant) for a platform admin, otherwise the tenants where the user holds an active ``admin``
    membership — a requester or approver membership elsewhere adds nothing, a revoked one
    removes its tenant, and a superuser who somehow holds a membership gets nothing (fail closed)."""
    if not user.is_active:
        return []
    rows = list(Membership.objects.filter(user_id=user.pk).values_list("tenant_id", "role", "is_active"))
    if user.is_superuser:
        return None if not rows else []
    return sorted({t for t, role, active in rows if active and role == Role.ADMIN})


def user_editable_by(target, tenant_ids: list[int] | None) -> bool:
    """May an admin whose :func:`admin_tenant_ids` are ``tenant_ids`` change, reset the password
    of, or delete user ``target``? A platform admin may (``None``). A tenant admin may only for a
    user who is neither staff nor superuser and all of whose memberships are in ``tenant_ids``."""
    if tenant_ids is None:
        return True
    if target.is_staff or target.is_superuser:
        return False
    theirs = set(Membership.objects.filter(user_id=target.pk).values_list("tenant_id", flat=True))
    return bool(theirs) and theirs <= set(tenant_ids)


def admin_scopes(user) -> dict[int, list[str]] | None:
    """``{tenant_id: knowledge scopes}`` ``user`` may read in the Django admin, for the tenants of
    :func:`admin_tenant_ids` (the scopes of the admin membership there), or ``None`` for a
    platform admin: an admin without the ``security`` scope reads no security chunk there either."""
    ids = admin_tenant_ids(user)
    if ids is None:
        return None
    rows = Membership.objects.filter(user_id=user.pk, tenant_id__in=ids).values_list("tenant_id", "scopes")
    return {tenant_id: list(scopes) for tenant_id, scopes in rows}
