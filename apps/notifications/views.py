"""The page channel of notifications: the bell in every page's header (an htmx fragment polled
every 15 s), the page listing a person's notifications, and "mark all read". A notification is
shown once its row is committed — the same row as its e-mail — in the reader's language."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from apps.accounts.pages import page_principal
from apps.core.pages import is_fragment_request, render_fragment, render_page
from apps.notifications.selectors import notifications_latest, notifications_page, notifications_unread_count
from apps.notifications.services import notifications_mark_read

#: notifications the bell lists
BELL_LATEST = 5


def _bell(request, p):
    return render_fragment(request, "notifications/_bell.html", {
        "unread": notifications_unread_count(principal=p),
        "latest": notifications_latest(principal=p, limit=BELL_LATEST)})


@login_required
@require_GET
def notification_bell(request):
    """``GET /notifications/bell/``: the bell's fragment — the unread count (swapped out of band
    into the header's badge) and the newest few notifications with their links. Two queries."""
    return _bell(request, page_principal(request))


@login_required
@require_GET
def notification_list(request):
    """``GET /notifications/``: the signed-in person's notifications, newest first, 30 a page
    (``?page=``), unread ones marked; the list fragment for an htmx request."""
    p = page_principal(request)
    page, rows = notifications_page(principal=p, page=request.GET.get("page", 1))
    return render_page(request, "notifications/list.html",
                       {"page": page, "rows": rows, "unread": notifications_unread_count(principal=p)},
                       fragment="notifications/_list.html")


@login_required
@require_POST
def notification_read_all(request):
    """``POST /notifications/read/``: mark all the person's notifications read; the bell's
    fragment for an htmx request (the bell's button), else back to the notifications page."""
    p = page_principal(request)
    notifications_mark_read(principal=p)
    if is_fragment_request(request):
        return _bell(request, p)
    return redirect("notification-list")
