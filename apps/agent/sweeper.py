"""The lease sweeper's selector (DESIGN.md §5): runnable tasks whose lease expired, or that sat
idle without a lease longer than ``idle`` (a lost Celery message)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Exists, OuterRef, Q, UUIDField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast

from apps.actions.models import Action
from apps.agent.intent import IN_FLIGHT
from apps.tasks import reducer
from apps.tasks.leases import compensation_due_q, lease_free_q, receipt_unsettled_q
from apps.tasks.models import Task

#: how long a receipt the outbox recorded on an action's row waits for its ``settle_receipts``
#: message before the sweeper sends the task's own agent step for it
SETTLE_GRACE = timedelta(seconds=30)

RUNNABLE = (reducer.ACCEPTED, reducer.RETRIEVING, reducer.PROPOSING, reducer.VALIDATING)


def tasks_needing_work(*, now: datetime, idle: timedelta, limit: int = 1000) -> list[tuple[str, str]]:
    """``[(status, task_id)]`` of tasks to re-queue, the longest untouched first, at most
    ``limit``: runnable statuses, tasks waiting for an approval that was decided (state says
    APPROVED), DISPATCHING tasks whose receipt is recorded (the answer is still to be composed),
    DISPATCHING and CANCELLED tasks whose action's row has held for ``SETTLE_GRACE`` a receipt the
    task has not recorded (the dispatcher's settlement message was lost or failed),
    waiting tasks past their deadline (so the controller records the explicit
    ``deadline_exceeded`` decision), and the compensations of ``reducer/2``."""
    expired = Q(lease_owner__isnull=False, lease_expires_at__lt=now)
    idle_free = Q(lease_owner__isnull=True, updated_at__lt=now - idle)
    runnable = (
        Q(status__in=RUNNABLE)
        | Q(status=reducer.WAITING_APPROVAL, state__approval__status="APPROVED")
        | (Q(status=reducer.DISPATCHING) & ~Q(state__receipt=None))
        # a receipt on the action's row the task has not recorded, for longer than a settle_receipts
        # message waiting behind a backlog would take (the agent step then records it itself)
        | receipt_unsettled_q(recorded_before=now - SETTLE_GRACE)
        | Q(status__in=[reducer.WAITING_INPUT, reducer.WAITING_APPROVAL], deadline_at__lt=now)
        # reducer/2: a cancelled task whose ticket was created anyway, not yet compensated, and a
        # compensation that is re-planning or waits on its approval (granted, or about to expire)
        | compensation_due_q()
        | (Q(status=reducer.COMPENSATING) & ~Q(state__compensation__status="DISPATCHING"))
    )
    # one ticket per fault: a report waiting for another report's create still in flight has
    # nothing to do until that settles; re-queueing it would only crowd this window
    waiting = Exists(Action.objects.filter(pk=OuterRef("coalesce_action"), status__in=IN_FLIGHT))
    rows = (Task.objects.filter(runnable).filter(expired | idle_free)
            .annotate(coalesce_action=Cast(KeyTextTransform("action_id", "state__coalesce"), UUIDField()))
            .exclude(Q(status=reducer.RETRIEVING, state__coalesce__isnull=False) & waiting).order_by("updated_at")
            .values_list("status", "id")[:limit])
    return [(s, str(i)) for s, i in rows]


def tasks_with_orphaned_reservations(*, now: datetime, limit: int = 200) -> list[str]:
    """Ids of ended tasks whose reducer keeps a ledger (``reducer/3`` on) that still hold open
    reservations while nobody holds their lease (a cancel: completion and failure release their
    own) — the activity's worker died after the cancel. The sweeper releases those reservations."""
    free = lease_free_q(now)
    ledgers = [version for version in reducer.FEATURES if reducer.supports(version, "ledger")]
    rows = (Task.objects.filter(status__in=reducer.TERMINAL, artifact_bundle__reducer__in=ledgers)
            .exclude(state__reservations={}).filter(free).values_list("id", flat=True)[:limit])
    return [str(i) for i in rows]
