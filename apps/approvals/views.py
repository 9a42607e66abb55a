"""The approver's queue (HTMX): approvals with the concrete tool, parameters (and
what changed since the task's previous proposal), target object with its version then and now,
side effects, evidence, requester and expiry; filters and pagination; approve or reject with a
reason without a page reload. Invalidated and expired approvals stay visible with their reason."""

from __future__ import annotations

from functools import reduce
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_GET, require_POST

from apps.accounts.pages import page_principal
from apps.actions.registry import TOOLS
from apps.approvals.selectors import QUEUE_STATUSES, approval_get, approval_queue_row
from apps.approvals.selectors import approval_queue as approval_queue_rows
from apps.approvals.services import approval_decide
from apps.core.errors import DomainError
from apps.core.pages import render_fragment, render_page

#: who decides when an approval names no roles (as :func:`apps.agent.authorization` reads it)
DEFAULT_APPROVER_ROLES = ("approver", "admin")
#: the roles (``apps.accounts.models.Role``) as a sentence names them: "decided by approver or admin"
ROLE_NAMES = {"requester": gettext_lazy("requester"), "approver": gettext_lazy("approver"),
              "admin": gettext_lazy("admin")}


def _decided_by(roles) -> str:
    """``roles`` (role codes) as the reader's language names them, e.g. "approver or admin"."""
    names = [str(ROLE_NAMES.get(r, r)) for r in (roles or DEFAULT_APPROVER_ROLES)]
    return reduce(lambda first, second: _("%(first)s or %(second)s") % {"first": first, "second": second}, names)


def _with_decided_by(row):
    """``row`` with ``decided_by``: who may decide its approval, for the row's template."""
    row.decided_by = _decided_by(row.approval.approver_roles)
    return row


@login_required
@require_GET
def approval_queue(request):
    """The queue: filters (status, tool, device), pagination, 20 rows a page. A full page, or —
    for an htmx request that is not a history restore — only the list fragment."""
    p = page_principal(request)
    if not p.is_approver:
        raise Http404("not an approver")
    status = request.GET.get("status", "PENDING")
    if status not in QUEUE_STATUSES:
        status = "PENDING"
    tool = request.GET.get("tool", "")
    tool = tool if tool in TOOLS else ""
    device = request.GET.get("device", "").strip()[:64]
    page, rows = approval_queue_rows(principal=p, status=status, tool=tool, device=device,
                                     page=request.GET.get("page", 1))
    query = urlencode({k: v for k, v in (("status", status), ("tool", tool), ("device", device)) if v})
    rows = [_with_decided_by(r) for r in rows]
    ctx = {"rows": rows, "page": page, "status": status, "tool": tool, "device": device, "query": query,
           "statuses": QUEUE_STATUSES, "tools": sorted(t for t, c in TOOLS.items() if c.kind == "write")}
    return render_page(request, "approvals/queue.html", ctx, fragment="approvals/_queue.html")


@login_required
@require_POST
def approval_decide_view(request, approval_id):
    p = page_principal(request)
    error = None
    try:
        approval_decide(principal=p, approval_id=approval_id, decision=request.POST.get("decision", ""),
                        reason=request.POST.get("reason", ""))
    except DomainError as exc:
        error = exc.detail
        status = exc.http_status
    else:
        status = 200
    approval = approval_get(principal=p, approval_id=approval_id)
    if approval is None:
        raise Http404("approval not found")
    row = _with_decided_by(approval_queue_row(principal=p, approval=approval))
    return render_fragment(request, "approvals/_row.html", {"r": row, "error": error}, status=status)
