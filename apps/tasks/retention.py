"""Retention of finished tasks: which tasks may be purged, and purging one batch of them (DESIGN.md
§13 "Retention"; spec agent-execution-system.md §16.2: the snapshot keeps references, versions and
budgets enough to recover, not every sensitive original by default).

A task is *eligible* for a purge level when all of these hold:

- it is terminal (``COMPLETED``, ``FAILED``, ``CANCELLED``) and has not changed since ``before``
  (its ``updated_at``: a late receipt or a compensation moves it, and restarts the clock);
- it is not already purged to that level or beyond;
- none of its actions is unreconciled (``INTENDED`` or ``UNKNOWN``): the reconciler and the
  dispatcher still read the task;
- for the ``payload`` level, none of its actions was created after ``keys_before``: inside the
  idempotency window (retries + reconciliation + the restore window, ``apps.actions.checks``) a
  restored backup can send the action again, and its record must still explain what it is.

A batch locks its tasks with ``FOR UPDATE SKIP LOCKED``: a task a worker holds is skipped this
run, never waited for, so the purge never blocks the hot path.

What the purge changes on the task row: ``symptom`` (the report) is emptied at ``payload``; the
state keeps only the keys in :data:`KEEP_STATE_KEYS` (status, budgets, counters, the action, its
receipt and approval ids — what a later receipt, compensation or SLA event needs) and empties the
rest at ``payload``; at ``excerpts`` only the evidence excerpts and quotes go. Events, refused
events and snapshots are purged by :mod:`apps.events.retention` in the same transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q

from apps.actions.models import Action, ActionStatus
from apps.core.retention import PurgeCounts, Purged, column_sizes, emptied, strip_keys
from apps.events import retention as event_retention
from apps.events.models import TaskEvent
from apps.events.retention import EXCERPT_KEYS, EXCERPTS, PAYLOAD
from apps.tasks import reducer
from apps.tasks.models import Task

#: Top-level state keys kept at the ``payload`` level: no report, device, evidence, draft or answer
#: text, only what later events of a terminal task (receipt, outcome, compensation, SLA, budget) read.
KEEP_STATE_KEYS = frozenset({
    "status", "budget", "limits", "model", "redrafts", "replans", "conflicts", "reservations",
    "cancel_requested", "termination_reason", "rejected_digests", "action", "receipt", "approval",
    "ticket_due", "compensation", "sla", "ticket_epoch",
})

UNRECONCILED = (ActionStatus.INTENDED, ActionStatus.UNKNOWN)


def purged_state(state: dict, level: str) -> dict:
    """``state`` as the purge leaves it at ``level`` (pure). Raises ``ValueError`` for an unknown
    level."""
    if level == EXCERPTS:
        return strip_keys(state, EXCERPT_KEYS)
    if level == PAYLOAD:
        return {k: (v if k in KEEP_STATE_KEYS else emptied(v)) for k, v in state.items()}
    raise ValueError(f"unknown purge level {level!r}")


def eligible_tasks(tenant_id: int, level: str, *, before: datetime, keys_before: datetime | None):
    """Tasks of ``tenant_id`` that may be purged to ``level`` now (see the module docstring),
    oldest first, as a queryset (not locked)."""
    lower = [lv for lv in event_retention.LEVELS if event_retention.level_rank(lv) < event_retention.level_rank(level)]
    unreconciled = Action.objects.filter(task_id=OuterRef("pk"), status__in=UNRECONCILED)
    # a task already at ``level`` that took events since (a late receipt, an SLA breach, a
    # compensation) is purged again, so what they wrote goes too
    later = TaskEvent.objects.filter(task_id=OuterRef("pk"), recorded_at__gt=OuterRef("purged_at"))
    qs = (Task.objects.for_tenant(tenant_id)
          .filter(Q(purged__in=lower) | (Q(purged=level) & Exists(later)),
                  status__in=sorted(reducer.TERMINAL), updated_at__lt=before)
          .exclude(Exists(unreconciled)))
    if keys_before is not None:
        qs = qs.exclude(Exists(Action.objects.filter(task_id=OuterRef("pk"), created_at__gte=keys_before)))
    return qs.order_by("updated_at")


def purge_task_batch(tenant_id: int, level: str, *, before: datetime, keys_before: datetime | None,
                     limit: int, at: datetime,
                     also: Callable[[list], PurgeCounts] | None = None) -> tuple[int, PurgeCounts]:
    """Purge up to ``limit`` eligible tasks of ``tenant_id`` to ``level`` in one transaction.
    ``also(task_ids)`` runs last in that transaction, with the ids of the tasks it purged: rows of
    apps above this one that go with their task (a decided approval's copies), so they are never
    left behind a purged task; its counts are added. Returns ``(tasks purged, counts)``; 0 tasks
    means nothing eligible was free to lock."""
    with transaction.atomic():
        ids = list(eligible_tasks(tenant_id, level, before=before, keys_before=keys_before)
                   .select_for_update(skip_locked=True, of=("self",))
                   .values_list("id", flat=True)[:limit])
        if not ids:
            return 0, PurgeCounts()
        counts = event_retention.purge_task_events(ids, level, at)
        table, size = Task._meta.db_table, "state, symptom"
        before_sizes = column_sizes(table, size, ids)
        for task in Task.objects.filter(id__in=ids).only("id", "state", "symptom"):
            symptom = "" if level == PAYLOAD else task.symptom
            # the new fencing token makes a lease holder that read the task before the purge lose its
            # write (a writer without the lease loses on ``purged``, apps/tasks/store.py)
            Task.objects.filter(id=task.id).update(state=purged_state(task.state, level), symptom=symptom,
                                                   purged=level, purged_at=at,
                                                   lease_generation=F("lease_generation") + 1)
        after_sizes = column_sizes(table, size, ids)
        counts.add(table, Purged(len(ids), sum(before_sizes.values()) - sum(after_sizes.values())))
        if also is not None:
            counts.merge(also(ids))
        return len(ids), counts
