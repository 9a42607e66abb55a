"""Reads of a person's notifications (the bell and the notifications page): always the
principal's own, in the principal's tenant (tenant-scoped, DESIGN.md §12)."""

from __future__ import annotations

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet

from apps.accounts.principal import Principal
from apps.notifications.compose import page_line
from apps.notifications.models import Notification


def notifications_of(*, principal: Principal) -> QuerySet[Notification]:
    """The principal's page notifications in their tenant, newest first."""
    return (Notification.objects.visible_to(principal)
            .filter(recipient_id=principal.user_id, on_page=True).order_by("-created_at", "-pk"))


def notifications_unread_count(*, principal: Principal) -> int:
    """How many of :func:`notifications_of` are unread. One query."""
    return notifications_of(principal=principal).filter(read_at__isnull=True).count()


def with_lines(rows) -> list[Notification]:
    """``rows`` with ``text`` and ``link`` set on each for a page, in the active language."""
    rows = list(rows)
    for n in rows:
        n.text, n.link = page_line(n)
    return rows


def notifications_latest(*, principal: Principal, limit: int = 5) -> list[Notification]:
    """The principal's ``limit`` newest notifications, with their words (:func:`with_lines`). One query."""
    return with_lines(notifications_of(principal=principal)[:limit])


def notifications_page(*, principal: Principal, page, per_page: int = 30) -> tuple[Page, list[Notification]]:
    """One page of :func:`notifications_of` (``page`` as the request sent it; Django's
    ``Paginator.get_page``) and its rows with their words. Two queries."""
    shown = Paginator(notifications_of(principal=principal), per_page).get_page(page)
    return shown, with_lines(shown.object_list)
