"""The authenticated principal: who acts, in which tenant, with which role and scopes.

Every tenant-scoped read and write in faultdesk takes a :class:`Principal`; it is resolved once per
request from the session/basic-auth user and its active membership (spec §16.1: identity and
permissions come from the program, not from the request text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.accounts.models import Membership, Role
from apps.core import sql


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

    @property
    def role_label(self) -> str:
        """The role as the reader's language names it (``Role``'s label), the code if unknown."""
        return str(dict(Role.choices).get(self.role, self.role))

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


def _principal_row(user_id: int, tenant_id: int | None) -> Principal | None:
    """The principal of ``user_id``'s active membership (in ``tenant_id``; with None, its first one
    by id — for signing in only), or None when there is none or the account is deactivated. One
    statement written once (:mod:`apps.core.sql`): principals are resolved on every request and
    re-checked at every moment of use, and the ORM's ``select_related`` of the membership, tenant
    and user cost about ten times the statement itself (docs/performance.md, "Hot reads in SQL")."""
    # t1 is the tenant, t2 the user (the order of ``related``).
    where, params = "t0.user_id = %s AND t0.is_active AND t2.is_active", [user_id]
    if tenant_id is not None:
        where, params = where + " AND t0.tenant_id = %s", [user_id, tenant_id]
    membership = sql.row(Membership, where, params, related=("tenant", "user"), tail="ORDER BY t0.id LIMIT 1")
    return principal_from_membership(membership) if membership is not None else None


def principal_for_user(user) -> Principal:
    """Resolve the principal of an authenticated ``user`` (its first active membership).

    Raises :class:`NoMembership` when the user belongs to no tenant, or the account is
    deactivated.
    """
    principal = _principal_row(user.pk, None)
    if principal is None:
        raise NoMembership(f"user {user.pk} has no active membership")
    from config.logs import bind

    bind(tenant_id=principal.tenant_id, user_id=user.pk)  # every later log line names tenant and user
    return principal


def principal_current(*, user_id: int, tenant_id: int) -> Principal | None:
    """Re-read a principal's *current* role and scopes (for re-checks at the moment of use,
    e.g. the approver's role at dispatch time, DESIGN.md §7). None when the membership is gone
    or inactive, or the user's account itself is deactivated (``User.is_active``) — and for a
    tenant id of None (no tenant: no membership), never a membership of some other tenant."""
    if tenant_id is None:
        return None
    return _principal_row(user_id, tenant_id)


def principals_current(*, user_ids, tenant_id: int) -> dict[int, Principal]:
    """``{user_id: Principal}`` of the active memberships in ``tenant_id`` of ``user_ids`` now (as
    :func:`principal_current` reads one; a user with none, or deactivated, is absent). One query,
    for pages that re-check many principals at once (the approval queue's requesters)."""
    rows = (Membership.objects.filter(tenant_id=tenant_id, user_id__in=list(user_ids), is_active=True,
                                      user__is_active=True)
            .select_related("tenant", "user").order_by("user_id", "id"))
    out: dict[int, Principal] = {}
    for membership in rows:
        out.setdefault(membership.user_id, principal_from_membership(membership))
    return out
