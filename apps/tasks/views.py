"""Requester pages (DESIGN.md §1): file a request, watch it live (HTMX polling until terminal),
answer questions, cancel. Views only call services/selectors."""

from __future__ import annotations

import re
from datetime import datetime

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import FileResponse, Http404
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from apps.accounts.pages import page_principal
from apps.attachments.selectors import attachment_of_task, attachment_open, task_attachments
from apps.attachments.services import attachments_check
from apps.attachments.uploads import recorded_uploads
from apps.core.errors import DomainError
from apps.core.pages import render_page
from apps.devices.selectors import device_list
from apps.tasks.forms import FaultRequestForm, InputForm
from apps.tasks.selectors import task_get, task_list, task_now
from apps.tasks.services import task_cancel, task_provide_input, task_submit
from apps.tickets.selectors import request_deadlines

_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    form = FaultRequestForm(request.POST or None, request.FILES or None, devices=devices)
    status = 200
    checked = None
    if request.method == "POST":
        # the files are checked whatever else is wrong, so every problem is told at once
        files, skipped = recorded_uploads(request, "attachments")
        try:
            checked = attachments_check([(name, f, f.content_type) for name, f in files], skipped)
        except DomainError as exc:
            for problem in exc.extra.get("attachments") or [exc.detail]:
                form.add_error("attachments", problem)
    if request.method == "POST" and form.is_valid() and checked is not None:
        try:
            result = task_submit(
                principal=p, device_id=int(form.cleaned_data["device"]), symptom=form.cleaned_data["symptom"],
                urgency=form.cleaned_data["urgency"], request_key=request.POST.get("request_key") or None,
                attachments=checked,
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
            "sla": _deadlines(task), "attachments": task_attachments(tenant_id=task.tenant_id, task_id=task.pk)}


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


def attachment_response(principal, task_id, sha256: str) -> FileResponse:
    """The stored file ``sha256`` of task ``task_id`` for ``principal``: 404 unless the principal may
    see the task (its requester, the tenant's approvers and admins; another tenant's task is as
    absent as a task that does not exist) and the task has that file (a file the retention purge
    took is a 404 saying so). A picture is shown in the page; anything else is downloaded. The
    answer cannot run in the browser (``nosniff`` and a sandboxing content security policy) and is
    not cached."""
    task = task_get(principal=principal, task_id=task_id) if _SHA256.fullmatch(sha256 or "") else None
    found = task and attachment_of_task(tenant_id=task.tenant_id, task_id=task.pk, sha256=sha256)
    if not found:
        raise Http404(_("attachment not found"))
    if found.purged_at is not None:
        raise Http404(_("the attachment's file was purged under the retention policy"))
    try:
        handle = attachment_open(found)
    except FileNotFoundError:
        raise Http404(_("the attachment's stored file is missing")) from None
    response = FileResponse(handle, content_type=found.content_type, as_attachment=found.kind != "image",
                            filename=found.name)
    response["X-Content-Type-Options"] = "nosniff"
    response["Content-Security-Policy"] = "default-src 'none'; img-src 'self'; sandbox"
    response["Cache-Control"] = "private, no-store"
    return response


@login_required
@require_GET
def task_attachment(request, task_id, sha256):
    """``GET /tasks/<id>/attachments/<sha256>/``: one attachment of a task (see
    :func:`attachment_response`)."""
    return attachment_response(page_principal(request), task_id, sha256)


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
