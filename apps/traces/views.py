"""Admin pages: the task list, a task's trace (its events in seq order with payloads, actors
and lease generations, plus refused events and actions with attempts), the metrics page; and the
Prometheus ``/metrics`` endpoint."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, JsonResponse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_GET

from apps.accounts.pages import page_admin
from apps.actions.models import Action
from apps.attachments.selectors import task_attachments
from apps.core.pages import is_fragment_request, render_page
from apps.events.models import RefusedEvent
from apps.tasks.selectors import (
    SENSITIVE_EVENTS,
    payload_shown,
    task_events,
    task_events_for_viewer,
    task_events_page,
    task_get,
    task_list,
)
from apps.traces.selectors import plan_versions


@login_required
@require_GET
def admin_tasks(request):
    p = page_admin(request)
    return render_page(request, "traces/tasks.html", {"tasks": task_list(principal=p)[:100]})


#: the causal chain of a task: the phase each event belongs to, in the order the
#: main job goes through them
PHASES = {
    "task.accepted": "request", "cancel.requested": "request", "input.requested": "request",
    "input.provided": "request",
    "retrieval.started": "evidence and device", "evidence.retrieved": "evidence and device",
    "ticket.read": "evidence and device", "device.read": "evidence and device",
    "budget.reserved": "budget", "budget.settled": "budget", "budget.released": "budget",
    "model.called": "model call", "draft.proposed": "proposal", "draft.invalid": "proposal",
    "approval.requested": "approval", "approval.granted": "approval", "approval.rejected": "approval",
    "approval.invalidated": "approval",
    "intent.committed": "intent", "intent.deferred": "intent", "sla.breached": "service level",
    "outcome.unknown": "reconciliation", "reconciliation.retry": "reconciliation",
    "dispatch.failed": "attempts", "dispatch.conflict": "attempts", "receipt.recorded": "receipt",
    "compensation.requested": "compensation", "compensation.failed": "compensation",
    "compensation.retry": "compensation", "compensation.resolved": "compensation",
    "task.completed": "answer", "task.failed": "end",
    # reducer/6: the reads are activities of a plan version; a version after the first is a re-plan
    "plan.activated": "evidence and device", "result.refused": "evidence and device",
    "read.failed": "evidence and device", "approval.revalidated": "approval",
}
#: what the trace shows for each phase (the keys above stay the codes the code compares)
PHASE_LABELS = {
    "request": gettext_lazy("request"), "evidence and device": gettext_lazy("evidence and device"),
    "budget": gettext_lazy("budget"), "model call": gettext_lazy("model call"),
    "proposal": gettext_lazy("proposal"), "approval": gettext_lazy("approval"), "intent": gettext_lazy("intent"),
    "reconciliation": gettext_lazy("reconciliation"), "attempts": gettext_lazy("attempts"),
    "receipt": gettext_lazy("receipt"), "compensation": gettext_lazy("compensation"),
    "answer": gettext_lazy("answer"), "end": gettext_lazy("end"), "other": gettext_lazy("other"),
    "service level": gettext_lazy("service level"), "re-plan": gettext_lazy("re-plan"),
}


#: events on one page of the trace (the export carries them all)
EVENTS_PER_PAGE = 100
#: event types whose phase is "budget": a ledger row between two steps, never the start of a phase
BUDGET_EVENTS = frozenset(t for t, phase in PHASES.items() if phase == "budget")


def _admin_task(request, task_id):
    p = page_admin(request)
    task = task_get(principal=p, task_id=task_id)
    if task is None:
        raise Http404("task not found")
    return p, task


def phase_of(event_type: str, plan_version=None) -> str:
    """The phase of an event (:data:`PHASES`): a ``plan.activated`` after the first version
    (``plan_version`` > 1, from its payload) starts a phase of its own, ``re-plan``."""
    if event_type == "plan.activated" and isinstance(plan_version, int) and plan_version > 1:
        return "re-plan"
    return PHASES.get(event_type, "other")


def _mark_phases(events, previous: str | None) -> None:
    """Give each event its ``phase`` (and the ``phase_label`` a person reads), ``new_phase`` (the
    first event of a phase, budget rows aside) and ``sensitive``; ``previous`` is the phase in force
    before the first of them."""
    for e in events:
        e.sensitive = e.type in SENSITIVE_EVENTS
        e.phase = phase_of(e.type, (e.payload or {}).get("version") if e.type == "plan.activated" else None)
        e.phase_label = PHASE_LABELS.get(e.phase, e.phase)
        e.new_phase = e.phase != previous and e.phase != "budget"
        previous = e.phase if e.phase != "budget" else previous


def _extras(p, task) -> dict:
    return {
        "refused": list(RefusedEvent.objects.visible_to(p).filter(task_id=task.pk).order_by("recorded_at")),
        "actions": list(Action.objects.visible_to(p).filter(task_id=task.pk).prefetch_related("attempts", "webhooks")),
        "attachments": task_attachments(tenant_id=task.tenant_id, task_id=task.pk),
    }


def _trace(request, task_id) -> dict:
    """The whole trace (the export): the viewer, the task, every event as the viewer may see it,
    refused events, actions with attempts and webhooks."""
    p, task = _admin_task(request, task_id)
    events = task_events_for_viewer(principal=p, task=task)
    _mark_phases(events, None)
    return {"principal": p, "task": task, "events": events, **_extras(p, task)}


def budget_series(task, events) -> list[tuple[int, int, int]]:
    """``[(seq, used, used + reserved)]`` of the task's cost units after each event, folded with
    the task's pinned reducer over the recorded events (no I/O). Empty when the log cannot be
    folded (e.g. a reducer version this build does not carry)."""
    from apps.tasks import reducer

    try:
        reduce = reducer.reducer_for((task.artifact_bundle or {}).get("reducer"))
        state, out = reducer.initial_state(), []
        for e in events:
            state = reduce(state, e.type, e.payload)
            b = state["budget"]
            out.append((e.seq, b["used"], b["used"] + b["reserved"]))
        return out
    except (reducer.IllegalTransition, reducer.UnknownReducer, KeyError, TypeError):
        return []


BUDGET_CHART_TITLE = gettext_lazy("Cost units over the events: used, and used + reserved")


def _budget_chart(p, task) -> str:
    """The SVG line chart of the task's cost units over all its events. It folds the recorded
    payloads as they are: only the ledger's figures leave this function, never a payload."""
    from apps.traces.charts import line_chart

    events = task_events(principal=p, task=task).only("seq", "type", "payload")
    return line_chart(budget_series(task, events), total=task.budget_total, title=BUDGET_CHART_TITLE)


@login_required
@require_GET
def task_trace(request, task_id):
    """The trace page: the task, one page of its events (:data:`EVENTS_PER_PAGE`, ``?page=N``; the
    pager's htmx requests, aimed at ``#events``, get only that section), refused events, actions.
    The cost chart is drawn on the page when every event is on it, and fetched as its own fragment
    (:func:`task_trace_budget`) for a longer task, so a page costs the same for 10 or 2,000 events.
    A task with plan versions (``reducer/6``) shows them side by side (:func:`plan_versions`: two
    queries more, whatever their number)."""
    p, task = _admin_task(request, task_id)
    page, events = task_events_page(principal=p, task=task, page=request.GET.get("page", 1),
                                    per_page=EVENTS_PER_PAGE)
    previous = None
    if events and events[0].seq > 1:
        before = (task_events(principal=p, task=task).filter(seq__lt=events[0].seq).exclude(type__in=BUDGET_EVENTS)
                  .order_by("-seq").values_list("type", "payload__version").first())
        previous = phase_of(*before) if before else None
    _mark_phases(events, previous)
    ctx = {"task": task, "events": events, "page": page, **_extras(p, task)}
    if is_fragment_request(request) and request.htmx.target == "events":  # the pager's links
        return render_page(request, "traces/trace.html", ctx, fragment="traces/_events.html")
    ctx["budget_chart"] = _budget_chart(p, task) if not page.has_other_pages() else None
    ctx["plans"] = plan_versions(principal=p, task=task)
    return render_page(request, "traces/trace.html", ctx)


@login_required
@require_GET
def task_trace_budget(request, task_id):
    """The cost chart of a task's trace on its own: the fragment the trace page of a long task
    loads, or a page of its own without htmx."""
    p, task = _admin_task(request, task_id)
    ctx = {"task": task, "budget_chart": _budget_chart(p, task)}
    return render_page(request, "traces/budget.html", ctx, fragment="traces/_budget.html")


@login_required
@require_GET
def task_trace_export(request, task_id):
    """The whole trace as one JSON document (``trace.json``): the task, every event, refused
    events, actions with their attempts and webhooks, and for a task with plan versions
    (``reducer/6``) ``plans`` (:meth:`~apps.traces.selectors.PlanTrace.as_dict`). Sensitive
    payloads are their digest and the link to their view, unless ``?include=payloads`` asks for
    them (as the viewer may see them)."""
    from django.http import JsonResponse

    ctx = _trace(request, task_id)
    task = ctx["task"]
    include = request.GET.get("include") == "payloads"
    doc = {
        "format": "faultdesk-trace/1",
        "task": {"id": str(task.pk), "tenant": task.tenant_id, "status": task.status, "version": task.version,
                 "termination_reason": task.termination_reason, "artifact_bundle": task.artifact_bundle,
                 "budget": {"total": task.budget_total, "used": task.budget_used, "reserved": task.budget_reserved},
                 "limits": task.state.get("limits"), "deadline_at": task.deadline_at.isoformat(),
                 "created_at": task.created_at.isoformat(), "lease_generation": task.lease_generation},
        "events": [{"seq": e.seq, "type": e.type, "occurred_at": e.occurred_at.isoformat(),
                    "recorded_at": e.recorded_at.isoformat(), "actor": e.actor, "lease_generation": e.lease_generation,
                    "causation_id": str(e.causation_id) if e.causation_id else None,
                    "payload_digest": e.payload_digest,
                    "payload": payload_shown(e, task_id=task.pk, include_sensitive=include)} for e in ctx["events"]],
        "refused_events": [{"at_version": r.at_version, "type": r.type, "reason": r.reason, "actor": r.actor,
                            "lease_generation": r.lease_generation, "recorded_at": r.recorded_at.isoformat()}
                           for r in ctx["refused"]],
        "actions": [{"id": str(a.pk), "tool": a.tool, "connector": a.connector, "status": a.status,
                     "idempotency_key": a.idempotency_key, "params_digest": a.params_digest,
                     "external_id": a.external_id,
                     "attempts": [{"number": t.number, "fencing_token": t.fencing_token, "outcome": t.outcome,
                                   "error": t.error, "started_at": t.started_at.isoformat(),
                                   "finished_at": t.finished_at.isoformat() if t.finished_at else None}
                                  for t in a.attempts.all()],
                     "webhooks": [{"event_id": h.event_id, "outcome": h.outcome, "reason": h.reason,
                                   "received_at": h.received_at.isoformat(), "body": h.body}
                                  for h in a.webhooks.all()]} for a in ctx["actions"]],
    }
    plans = plan_versions(principal=ctx["principal"], task=task)
    if plans is not None:  # reducer/6: the plan versions with their premises, barriers and read activities
        doc["plans"] = plans.as_dict()
    response = JsonResponse(doc, json_dumps_params={"indent": 1})
    response["Content-Disposition"] = f'attachment; filename="trace-{task.pk}.json"'
    return response


@require_GET
def healthz(request):
    """``GET /healthz``: readiness for a load balancer (no authentication, no tenant data): 200
    ``{"status": "ok", …figures}`` when PostgreSQL and the broker answer, no transaction has been
    open too long and the outbox keeps up; otherwise 503 ``{"status": "unavailable", "problems"}``
    (apps/traces/health.py)."""
    from apps.traces.health import health_check

    health = health_check()
    return JsonResponse(health.as_dict(), status=200 if health.ok else 503)


@require_GET
def prometheus_metrics(request):
    """``GET /metrics``: the Prometheus text exposition (no tenant labels, bounded label sets). When
    ``FAULTDESK_METRICS_TOKEN`` is set, the scraper must send ``Authorization: Bearer <token>``."""
    from prometheus_client import CONTENT_TYPE_LATEST

    from apps.traces.metrics import prometheus_text

    token = settings.FAULTDESK.get("METRICS_TOKEN") or ""
    given = request.headers.get("Authorization", "").encode("utf-8", "replace")
    if token and not hmac.compare_digest(given, f"Bearer {token}".encode()):
        return HttpResponse(_("a bearer token is required") + "\n", status=401, content_type="text/plain")
    return HttpResponse(prometheus_text(), content_type=CONTENT_TYPE_LATEST)


@login_required
@require_GET
def metrics_page(request):
    """The admin's metrics for their tenant: rates, duplicates, interventions, cost and latency
    percentiles by artifact version, and per day (a fixed number of queries)."""
    from apps.traces.charts import bar_chart
    from apps.traces.metrics import tenant_metrics

    p = page_admin(request)
    m = tenant_metrics(tenant_id=p.tenant_id)
    charts = {
        "tasks": bar_chart([(str(d["day"])[5:], d["completed"], d["failed"] + d["cancelled"]) for d in m["by_day"]],
                           title=_("Requests per day: completed, and failed or cancelled")),
        "cost": bar_chart([(str(d["day"])[5:], d["cost"], 0) for d in m["by_day"]], title=_("Cost units per day")),
    }
    return render_page(request, "traces/metrics.html", {"m": m, "charts": charts})


@login_required
@require_GET
def task_event_payload(request, task_id, seq: int):
    """One event's payload, for an admin of the task's tenant, as that admin may see it now
    (evidence excerpts of scopes they cannot read are replaced). The trace links here instead of
    printing sensitive payloads inline."""
    from apps.evidence.selectors import payload_for_viewer, readable_chunk_ids
    from apps.tasks.selectors import task_events

    p = page_admin(request)
    task = task_get(principal=p, task_id=task_id)
    event = task_events(principal=p, task=task).filter(seq=seq).first() if task is not None else None
    if event is None:
        raise Http404("event not found")
    cited = {r.get("chunk_id") for r in event.payload.get("refs", [])} if event.type == "evidence.retrieved" else set()
    readable = readable_chunk_ids(tenant_id=p.tenant_id, scopes=p.scopes, chunk_ids=cited) if cited else set()
    payload = payload_for_viewer(event.type, event.payload, readable)
    return render_page(request, "traces/event.html", {"task": task, "event": event, "payload": payload})
