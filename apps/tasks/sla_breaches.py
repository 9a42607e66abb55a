"""Service-level breaches on the record (apps/tickets/sla.py; ``reducer/4``'s ``sla.breached``): a
beat job finds requests not answered by their respond-by date and tickets not resolved by their
due date, and appends one ``sla.breached`` event to each such task — once per kind, so the trace,
the exports and a replay show when the tenant's service level was missed.

* ``respond``: a task still running (any non-terminal status) past its respond-by date, counted
  from its filing at its proposed priority (else its urgency's), under the tenant's policy now —
  or one answered (``task.completed``) after that date, also when it ended between two beats.
* ``resolve``: a ticket faultdesk created whose mirror is still open (``open``, ``in_progress``)
  past the ``due_at`` it was created with; its task has usually ended (the event is legal there).
  Only for ticket systems whose mirrors are kept current (the reference service's webhooks and
  conditional reads); django-helpdesk's mirror is not refreshed, so its tickets are not judged.

Only tasks pinned to a reducer with the ``sla`` feature take the event, and only while nobody
holds their lease: the beat never races a running worker's compare-and-set (the next beat finds a
task it skipped). A task whose event is refused or whose CAS is lost is left for the next beat."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import DatabaseError
from django.db.models import Q
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone

from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.leases import lease_free_q
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, task_append_event
from apps.tickets.connectors import CONNECTORS
from apps.tickets.models import TicketMirror
from apps.tickets.selectors import OPEN_STATUSES, sla_policy_for
from apps.tickets.sla import SlaConfigError, request_priority

log = logging.getLogger(__name__)

#: the actor recorded on the events this job appends
ACTOR = "beat:sla"
#: how far back the job looks for requests answered late (its beat runs every minute)
ANSWERED_WINDOW = timedelta(days=1)


def _sla_versions() -> list[str]:
    return [version for version in reducer.FEATURES if reducer.supports(version, "sla")]


def _not_recorded(state: str, kind: str) -> Q:
    """Rows whose task state (at the path ``state``) has no ``kind`` breach yet: no ``sla`` at all,
    or an ``sla`` without ``kind`` (a bare ``exclude`` of the nested key would drop the first)."""
    return Q(**{f"{state}__sla__isnull": True}) | ~Q(**{f"{state}__sla__has_key": kind})


def _record(task: Task, kind: str, due: datetime | str, priority: str | None, now: datetime) -> bool:
    """Append ``task``'s breach of ``kind``; False when it cannot be now (left for the next beat).

    The commit also carries the fencing token the task had when it was read with no lease holder:
    a worker that claims the task in between moves the token, so this write fails instead of the
    worker's (a claim does not move the version the CAS compares)."""
    payload = {"kind": kind, "due": due if isinstance(due, str) else due.isoformat(timespec="seconds"),
               "priority": priority, "observed_at": now.isoformat(timespec="seconds")}
    try:
        task_append_event(task=task, event_type="sla.breached", payload=payload, actor=ACTOR,
                          lease_generation=task.lease_generation)
    except (StaleWrite, reducer.IllegalTransition, DatabaseError) as exc:
        log.info("sla breach of task %s not recorded now: %s", task.pk, exc)
        return False
    return True


def sla_breaches_mark(*, now: datetime | None = None, limit: int = 200) -> dict[str, int]:
    """Record the breaches due at ``now`` (default: now), at most ``limit`` of each kind per call;
    returns ``{"respond": n, "resolve": m}``, the events appended. A tenant whose SLA policy cannot
    give a date is skipped (logged)."""
    now = now or timezone.now()
    versions, policies, done = _sla_versions(), {}, {"respond": 0, "resolve": 0}

    def policy(tenant_id: int):
        if tenant_id not in policies:
            try:
                policies[tenant_id] = sla_policy_for(tenant_id)
            except SlaConfigError as exc:
                log.warning("tenant %s: SLA policy unusable, no breaches marked: %s", tenant_id, exc)
                policies[tenant_id] = None
        return policies[tenant_id]

    running = (Task.objects.filter(artifact_bundle__reducer__in=versions, status__in=reducer.NON_TERMINAL)
               .filter(lease_free_q(now)).filter(_not_recorded("state", "respond")))
    # the tenants whose policy can give dates: a tenant whose policy cannot never fills the window
    usable = [t for t in running.values_list("tenant_id", flat=True).distinct() if policy(t) is not None]
    for task in running.filter(tenant_id__in=usable).order_by("created_at")[:limit * 5]:
        priority = request_priority(task.state, task.urgency)
        try:
            due = policy(task.tenant_id).deadlines(task.created_at, priority).respond_by
        except SlaConfigError as exc:  # a target past the calendar's horizon: this tenant is skipped
            log.warning("tenant %s: no respond-by date for task %s: %s", task.tenant_id, task.pk, exc)
            continue
        if due <= now and _record(task, "respond", due, priority, now):
            done["respond"] += 1
            if done["respond"] >= limit:
                break

    # answered late between two beats (or while a worker held the task): the answer's own time
    # against its respond-by date, for requests answered within the last day
    answered = (Task.objects.filter(artifact_bundle__reducer__in=versions, status=reducer.COMPLETED,
                                    updated_at__gte=now - ANSWERED_WINDOW)
                .filter(lease_free_q(now)).filter(_not_recorded("state", "respond")))
    usable = [t for t in answered.values_list("tenant_id", flat=True).distinct() if policy(t) is not None]
    for task in answered.filter(tenant_id__in=usable).order_by("updated_at")[:limit * 5]:
        completed = (TaskEvent.objects.filter(task_id=task.pk, type="task.completed")
                     .values_list("recorded_at", flat=True).first())
        priority = request_priority(task.state, task.urgency)
        try:
            due = policy(task.tenant_id).deadlines(task.created_at, priority).respond_by
        except SlaConfigError:
            continue
        if completed is not None and due < completed and _record(task, "respond", due, priority, now):
            done["respond"] += 1

    # mirrors a ticket system keeps current (its webhooks and conditional reads): a mirror nobody
    # refreshes says "open" forever, and its ticket would be marked late however it stands
    kept = [name for name, c in CONNECTORS.items() if c.supports_conditional_writes]
    late = (TicketMirror.objects.filter(status__in=OPEN_STATUSES, action__compensates__isnull=True, connector__in=kept,
                                        action__task__artifact_bundle__reducer__in=versions)
            .annotate(due=KeyTextTransform("due_at", "action__params"))
            .filter(due__lt=now.isoformat(timespec="seconds"))
            .filter(_not_recorded("action__task__state", "resolve"))
            .select_related("action")[:limit])
    for mirror in late:
        task = Task.objects.filter(pk=mirror.action.task_id).filter(lease_free_q(now)).first()
        if task is not None and _record(task, "resolve", mirror.due, mirror.action.params.get("priority"), now):
            done["resolve"] += 1
    return done
