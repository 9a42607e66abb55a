"""The authenticated principal: who acts, in which tenant, with which role and scopes.

Every tenant-scoped read and write in faultdesk takes a :class:`Principal`; it is resolved once per
request from the session/basic-auth user and its active membership (spec §16.1: identity and
permissions come from the program, not from the request text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.accounts.models import Membership, Role


class NoMembership(PermissionError):
    """The user has no active membership in any tenant."""


@dataclass(frozen=True)
class Principal:
    """An authenticated user acting in one tenant.

    ``scopes`` are the knowledge access scopes (``public``, ``tier2``, ``security``) the
    principal may read; retrieval applies them in SQL (DESIGN.md §9).
    """

    user_id: int
    username: str
    tenant_id: int
    tenant_slug: str
    role: str
    scopes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_requester(self) -> bool:
        """May file fault requests: requesters and admins."""
        return self.role in (Role.REQUESTER, Role.ADMIN)

    @property
    def is_approver(self) -> bool:
        return self.role in (Role.APPROVER, Role.ADMIN)

    @property
    def is_admin(self) -> bool:
        return self.role == Role.ADMIN

    def as_actor(self) -> str:
        """The actor string recorded on events: ``user:<username>``."""
        return f"user:{self.username}"


def principal_from_membership(membership: Membership) -> Principal:
    return Principal(
        user_id=membership.user_id,
        username=membership.user.get_username(),
        tenant_id=membership.tenant_id,
        tenant_slug=membership.tenant.slug,
        role=membership.role,
        scopes=tuple(membership.scopes),
    )


def principal_for_user(user) -> Principal:
    """Resolve the principal of an authenticated ``user`` (its first active membership).

    Raises :class:`NoMembership` when the user belongs to no tenant, or the account is
    deactivated.
    """
    membership = (
        Membership.objects.select_related("tenant", "user")
        .filter(user_id=user.pk, is_active=True, user__is_active=True)
        .order_by("id")
        .first()
    )
    if membership is None:
        raise NoMembership(f"user {user.pk} has no active membership")
    from config.logs import bind

    bind(tenant_id=membership.tenant_id, user_id=user.pk)  # every later log line names tenant and user
    return principal_from_membership(membership)


def principal_current(*, user_id: int, tenant_id: int) -> Principal | None:
    """Re-read a principal's *current* role and scopes (for re-checks at the moment of use,
    e.g. the approver's role at dispatch time, DESIGN.md §7). None when the membership is gone
    or inactive, or the user's account itself is deactivated (``User.is_active``)."""
    membership = (
        Membership.objects.select_related("tenant", "user")
        .filter(user_id=user_id, tenant_id=tenant_id, is_active=True, user__is_active=True)
        .first()
    )
    return principal_from_membership(membership) if membership else None
