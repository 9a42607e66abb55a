"""Admin pages: the task list and a task's trace (its events in seq order with payloads,
actors and lease generations, plus refused events and actions with attempts)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_GET

from apps.actions.models import Action
from apps.events.models import RefusedEvent
from apps.tasks.selectors import task_events_for_viewer, task_get, task_list
from apps.tasks.views import _principal


def _admin(request):
    p = _principal(request)
    if not p.is_admin:
        raise Http404("admins only")
    return p


@login_required
@require_GET
def admin_tasks(request):
    p = _admin(request)
    return render(request, "traces/tasks.html", {"tasks": task_list(principal=p)[:100]})


@login_required
@require_GET
def task_trace(request, task_id):
    p = _admin(request)
    task = task_get(principal=p, task_id=task_id)
    if task is None:
        raise Http404("task not found")
    ctx = {
        "task": task,
        "events": task_events_for_viewer(principal=p, task=task),
        "refused": RefusedEvent.objects.visible_to(p).filter(task_id=task.pk).order_by("recorded_at"),
        "actions": Action.objects.visible_to(p).filter(task_id=task.pk).prefetch_related("attempts",
                                                                                                  "webhooks"),
    }
    return render(request, "traces/trace.html", ctx)
