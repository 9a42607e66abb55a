"""Requester pages (DESIGN.md §1): file a request, watch it live (HTMX polling until terminal),
answer questions, cancel. Views only call services/selectors."""

from __future__ import annotations

from datetime import datetime

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.accounts.pages import page_principal
from apps.core.errors import DomainError
from apps.core.pages import render_page
from apps.devices.selectors import device_list
from apps.tasks.forms import FaultRequestForm, InputForm
from apps.tasks.selectors import task_get, task_list, task_now
from apps.tasks.services import task_cancel, task_provide_input, task_submit
from apps.tickets.selectors import request_deadlines


@login_required
@require_GET
def home(request):
    p = page_principal(request)
    if p.is_admin:
        return redirect("admin-tasks")
    if p.is_approver:
        return redirect("approval-queue")
    return redirect("request-list")


@login_required
@require_GET
def request_list(request):
    p = page_principal(request)
    return render(request, "tasks/request_list.html", {"tasks": task_list(principal=p)[:50]})


@login_required
@require_http_methods(["GET", "POST"])
def request_new(request):
    p = page_principal(request)
    if not p.is_requester:
        raise PermissionDenied("only requesters and admins file fault requests")
    devices = list(device_list(principal=p))
    form = FaultRequestForm(request.POST or None, devices=devices)
    status = 200
    if request.method == "POST" and form.is_valid():
        try:
            result = task_submit(
                principal=p, device_id=int(form.cleaned_data["device"]), symptom=form.cleaned_data["symptom"],
                urgency=form.cleaned_data["urgency"], request_key=request.POST.get("request_key") or None,
            )
        except DomainError as exc:
            form.add_error(None, exc.detail)
            status = 429 if exc.http_status == 429 else 422  # a spent quota is "too many", not "invalid"
        else:
            return redirect("task-detail", task_id=result.task.pk)
    if form.errors and status == 200:
        status = 422
    return render(request, "tasks/request_new.html", {"form": form}, status=status)


def _task_context(request, task_id):
    p = page_principal(request)
    task = task_get(principal=p, task_id=task_id)
    if task is None:
        raise Http404("task not found")
    typed = request.session.pop("draft_answer", None) if hasattr(request, "session") else None
    input_form = InputForm(initial={"text": typed}) if typed else InputForm()
    return {"task": task, "state": task.state, "principal": p, "input_form": input_form, "now": task_now(task),
            "sla": _deadlines(task)}


def _deadlines(task) -> dict | None:
    """The request's due dates for its page (apps/tickets/sla.py): ``{"priority", "respond_by",
    "overdue", "resolve_by"}`` under its tenant's service levels at its proposed priority (else its
    urgency's) — the resolve-by date being the one its ticket was proposed and sent with when there
    is one — or None when the tenant's SLA policy cannot give a date."""
    due = request_deadlines(tenant_id=task.tenant_id, created_at=task.created_at, state=task.state,
                            urgency=task.urgency)
    if due is None:
        return None
    sent = (((task.state or {}).get("proposal") or {}).get("params") or {}).get("due_at")
    try:
        resolve_by = datetime.fromisoformat(sent) if isinstance(sent, str) else due.resolve_by
    except ValueError:
        resolve_by = due.resolve_by
    return {"priority": due.priority, "respond_by": due.respond_by, "overdue": due.respond_by <= timezone.now(),
            "resolve_by": resolve_by}


@login_required
@require_GET
def task_detail(request, task_id):
    ctx = _task_context(request, task_id)
    return render_page(request, "tasks/task_detail.html", ctx, fragment="tasks/_status.html")


@login_required
@require_POST
def task_cancel_view(request, task_id):
    p = page_principal(request)
    try:
        task_cancel(principal=p, task_id=task_id, reason=request.POST.get("reason", ""))
    except DomainError as exc:
        messages.error(request, exc.detail)
    return redirect("task-detail", task_id=task_id)


@login_required
@require_POST
def task_input_view(request, task_id):
    p = page_principal(request)
    form = InputForm(request.POST)
    if form.is_valid():
        try:
            task_provide_input(principal=p, task_id=task_id, text=form.cleaned_data["text"])
        except DomainError as exc:
            messages.error(request, exc.detail)
    else:
        # the form's own message (empty, or longer than it takes) — and what was typed is kept
        for error in form.errors.get("text", [_("Please write an answer.")]):
            messages.error(request, error)
        request.session["draft_answer"] = request.POST.get("text", "")[:20_000]
    return redirect("task-detail", task_id=task_id)
