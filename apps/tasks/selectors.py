"""Tenant-scoped reads of tasks and their events. Every function takes the principal: there is no
way to fetch a task without naming whose eyes read it."""

from __future__ import annotations

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.utils.translation import gettext as _

from apps.accounts.principal import Principal
from apps.events.models import TaskEvent
from apps.tasks.models import STATUS_LABELS, Task


def task_list(*, principal: Principal) -> QuerySet[Task]:
    """Tasks the principal may see: requesters their own, approvers and admins the tenant's."""
    qs = Task.objects.visible_to(principal).select_related("device", "requester")
    if not (principal.is_approver or principal.is_admin):
        qs = qs.filter(requester_id=principal.user_id)
    return qs.order_by("-created_at")


def task_get(*, principal: Principal, task_id) -> Task | None:
    """One task visible to the principal, or None (also for another tenant's task)."""
    return task_list(principal=principal).filter(pk=task_id).first()


def task_events(*, principal: Principal, task: Task) -> QuerySet[TaskEvent]:
    """The task's events in seq order (the caller has already checked access to ``task``)."""
    return TaskEvent.objects.visible_to(principal).filter(task_id=task.pk).order_by("seq")


def _viewer_copies(principal: Principal, events: list) -> list:
    """``events`` with evidence excerpts of scopes ``principal`` cannot read now replaced by a
    notice in each (unsaved) ``payload``."""
    from apps.evidence.selectors import payload_for_viewer, readable_chunk_ids

    cited = {r.get("chunk_id") for e in events if e.type == "evidence.retrieved" for r in e.payload.get("refs", [])}
    readable = readable_chunk_ids(tenant_id=principal.tenant_id, scopes=principal.scopes, chunk_ids=cited) \
        if cited else set()
    for e in events:
        e.payload = payload_for_viewer(e.type, e.payload, readable)
    return events


def task_events_for_viewer(*, principal: Principal, task: Task) -> list:
    """The task's events in seq order as ``principal`` may see them: evidence excerpts of scopes the
    viewer cannot read now are replaced by a notice in the (unsaved) ``payload`` of each event."""
    return _viewer_copies(principal, list(task_events(principal=principal, task=task)))


def task_events_page(*, principal: Principal, task: Task, page, per_page: int) -> tuple[Page, list]:
    """One page of the task's events in seq order, as :func:`task_events_for_viewer` shows them:
    ``(the page, its events)``. ``page`` is a page number as the request sent it (a string or an
    int); anything that is not a page number gives the first page, a number past the end the last
    (Django's ``Paginator.get_page``). Costs one count and one page of rows, whatever the task's
    length (the admin's trace, DESIGN.md §1)."""
    paginator = Paginator(task_events(principal=principal, task=task), per_page)
    shown = paginator.get_page(page)
    return shown, _viewer_copies(principal, list(shown.object_list))


def task_now(task: Task) -> str:
    """What the task is doing or waiting for right now, in the requester's words (the live
    progress line of the request page)."""
    state = task.state or {}
    model = state.get("model") or {}
    last = (model.get("last") or {}).get("outcome")
    steps = {
        "ACCEPTED": _("Queued: the agent starts in a moment."),
        "RETRIEVING": _("Searching the knowledge base and reading the device's current state."),
        "PROPOSING": (_("Drafting the ticket: the model's last reply could not be used, asking again.")
                      if last == "malformed" else
                      _("Drafting the ticket: the model did not answer, trying again shortly.")
                      if last in ("unavailable", "rate_limited", "timeout") else _("Drafting the ticket.")),
        "VALIDATING": _("Checking the draft against the rules."),
        "WAITING_INPUT": _("Waiting for your answer to the agent's questions below."),
        "WAITING_APPROVAL": _("Waiting for an approver to review the proposal."),
        "DISPATCHING": (_("Writing the answer.") if state.get("receipt")
                        else _("Sending the change to the ticket system.")),
        "WAITING_RECONCILIATION": _("Confirming with the ticket system whether the change was made."),
        "COMPENSATING": _("Cancelled; handling the ticket that was created before the cancel."),
        "WAITING_COMPENSATION": _("Cancelled; an admin decides about the ticket that was created."),
    }
    if state.get("coalesce") and task.status == "RETRIEVING":
        return _("Another report about this device is creating its ticket: yours joins that ticket once it exists.")
    if task.is_terminal:
        if task.outcome_pending:
            return _("Still confirming the last change with the ticket system.")
        return {"COMPLETED": _("Done."), "FAILED": _("Stopped: the request failed, for the reason above."),
                "CANCELLED": _("Stopped: the request was cancelled.")}.get(task.status, _("Stopped."))
    return steps.get(task.status, str(STATUS_LABELS.get(task.status, task.status)))


#: events whose payload carries people's words, document text or model output:
#: traces show their digest and link to the access-checked view of the payload
SENSITIVE_EVENTS = frozenset({"task.accepted", "evidence.retrieved", "model.called", "draft.proposed",
                              "input.provided", "input.requested", "approval.requested", "intent.committed",
                              "task.completed"})


def payload_shown(event, *, task_id, include_sensitive: bool) -> dict:
    """An event's payload for a listing (trace export, events API): as the viewer may see it when
    it is not sensitive or when ``include_sensitive``; otherwise ``{"sensitive": True, "digest",
    "view"}`` pointing at the access-checked payload view."""
    from django.urls import reverse

    if include_sensitive or event.type not in SENSITIVE_EVENTS:
        return event.payload
    return {"sensitive": True, "digest": event.payload_digest,
            "view": reverse("task-event", args=[task_id, event.seq])}
