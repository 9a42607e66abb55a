"""The admin's reconciliation page (HTMX): actions whose outcome is unknown, what is known about
each (attempts with their errors, lookups by key so far), and the two recorded resolutions
(DESIGN.md §6). The same through the API in :mod:`apps.outbox.api`."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET, require_POST

from apps.accounts.pages import page_admin
from apps.actions.models import Action
from apps.core.errors import DomainError
from apps.core.pages import render_fragment, render_page
from apps.outbox.reconciliation import UnknownAction, reconciliation_list, reconciliation_resolve
from apps.tasks.compensation import compensation_settle, compensations_waiting
from apps.tasks.models import Task


@login_required
@require_GET
def reconciliation_page(request):
    p = page_admin(request)
    return render_page(request, "reconciliation/page.html", {"rows": reconciliation_list(principal=p),
                                                              "compensations": compensations_waiting(principal=p)})


@login_required
@require_POST
def reconciliation_resolve_view(request, action_id):
    p = page_admin(request)
    error, status = None, 200
    executed = request.POST.get("executed")
    try:
        if executed not in ("yes", "no"):
            raise _Choice(_("choose “executed” or “not executed”"))
        reconciliation_resolve(principal=p, action_id=action_id, executed=executed == "yes",
                               external_id=request.POST.get("external_id", ""), note=request.POST.get("note", ""))
    except DomainError as exc:
        error, status = exc.detail, exc.http_status
    action = (Action.objects.visible_to(p).filter(pk=action_id)
              .select_related("task", "task__device", "task__requester").prefetch_related("attempts").first())
    if action is None:
        raise Http404("action not found")
    row = next((r for r in reconciliation_list(principal=p) if r.action.pk == action.pk), None)
    row = row or UnknownAction(action, False, "")
    return render_fragment(request, "reconciliation/_row.html", {"r": row, "error": error}, status=status)


class _Choice(DomainError):
    http_status = 422
    code = "unprocessable"


@login_required
@require_POST
def compensation_settle_view(request, task_id):
    """HTMX: record an admin's decision on a failed compensation; answers the task's card."""
    p = page_admin(request)
    error, status = None, 200
    try:
        compensation_settle(principal=p, task_id=task_id, decision=request.POST.get("decision", ""),
                            note=request.POST.get("note", ""))
    except DomainError as exc:
        error, status = exc.detail, exc.http_status
    task = Task.objects.visible_to(p).filter(pk=task_id).select_related("device", "requester").first()
    if task is None:
        raise Http404("task not found")
    return render_fragment(request, "reconciliation/_compensation.html", {"t": task, "error": error},
                           status=status)
