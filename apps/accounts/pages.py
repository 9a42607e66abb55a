"""Page helpers of the people's pages that need the tenant model: who is asking.
(The renderer itself, which needs no app, is :func:`apps.core.pages.render_page`.)"""

from __future__ import annotations

from django.http import Http404

from apps.accounts.principal import NoMembership, Principal, principal_for_user


def page_principal(request) -> Principal:
    """The principal of a signed-in page request (DESIGN.md §8: every page is scoped to the
    member's tenant). Raises :class:`~django.http.Http404` when the user belongs to no tenant, so
    a page never tells a stranger what exists."""
    try:
        return principal_for_user(request.user)
    except NoMembership as exc:
        raise Http404("no tenant") from exc


def page_admin(request) -> Principal:
    """:func:`page_principal` for an admin-only page (traces, reconciliation): Http404 for anyone
    else, so the page's existence is not shown to them."""
    p = page_principal(request)
    if not p.is_admin:
        raise Http404("admins only")
    return p
