"""The approver's queue (HTMX): pending approvals with the concrete tool, parameters, target
object and version, side effects and evidence; approve/reject without a page reload."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_GET, require_POST

from apps.accounts.api import DomainError
from apps.approvals.models import ApprovalStatus
from apps.approvals.selectors import approval_get, approval_list
from apps.approvals.services import approval_decide
from apps.tasks.views import _principal


@login_required
@require_GET
def approval_queue(request):
    p = _principal(request)
    if not p.is_approver:
        raise Http404("not an approver")
    status = request.GET.get("status", ApprovalStatus.PENDING)
    if status not in ApprovalStatus.values:
        status = ApprovalStatus.PENDING
    approvals = approval_list(principal=p, status=status)[:50]
    response = render(request, "approvals/queue.html",
                      {"approvals": approvals, "status": status, "statuses": ApprovalStatus.choices})
    patch_vary_headers(response, ("HX-Request",))
    return response


@login_required
@require_POST
def approval_decide_view(request, approval_id):
    p = _principal(request)
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
    response = render(request, "approvals/_row.html", {"a": approval, "error": error}, status=status)
    patch_vary_headers(response, ("HX-Request",))
    return response
