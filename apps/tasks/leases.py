"""Leases on a task with fencing tokens (DESIGN.md §5; spec §16.3): one worker at a time acts on
a task, and each claim increments ``lease_generation``, the token every commit must carry
(:func:`apps.tasks.store.task_append_event`), so a worker that lost its lease cannot commit."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, UUIDField
from django.db.models.fields.json import KeyTextTransform, KeyTransform
from django.db.models.functions import Cast
from django.utils import timezone

from apps.actions.models import Action, ActionStatus
from apps.core import sql
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.runs import open_run
from apps.tasks.store import StaleWrite, worker_identity


@dataclass(frozen=True)
class Lease:
    """A claim on a task: ``generation`` is the fencing token every commit must carry."""

    task_id: uuid.UUID
    owner: str
    generation: int


def lease_free_q(now) -> Q:
    """Tasks nobody holds at ``now``: no lease owner, or a lease that expired."""
    return Q(lease_owner__isnull=True) | Q(lease_expires_at__lt=now)


def compensation_due_q() -> Q:
    """Tasks a compensation is due for (``reducer/2``): cancelled, their ticket created anyway
    (a receipt of kind ticket: no ``kind`` key), and no compensation asked for yet. Terminal, yet
    still claimable by the agent, which asks for the compensation."""
    return (Q(status=reducer.CANCELLED, artifact_bundle__reducer__in=reducer.V2_PLAN,
              state__compensation=None)
            & ~Q(state__receipt=None) & Q(state__receipt__kind__isnull=True))


def receipt_unsettled_q(*, recorded_before=None) -> Q:
    """Tasks in DISPATCHING or CANCELLED whose current action's row (the one the agent's step reads)
    holds a receipt their state does not: the outbox's batch recorded it on its rows and the task's
    half (the ``settle_receipts`` message) has not run — lost, failed, or still queued. A cancelled
    one is terminal, yet still claimable by the agent, which records the receipt (and then asks for
    a compensation, if due). ``recorded_before``: only receipts the row got before that time."""
    current = Cast(KeyTextTransform("id", KeyTransform("action", OuterRef("state"))), UUIDField())
    rows = Action.objects.filter(task_id=OuterRef("pk"), id=current, status=ActionStatus.SUCCEEDED,
                                 compensates__isnull=True)
    if recorded_before is not None:
        rows = rows.filter(updated_at__lt=recorded_before)
    return Q(status__in=[reducer.DISPATCHING, reducer.CANCELLED], state__receipt=None) & Exists(rows)


_CLAIM_SQL = """
UPDATE {task} SET lease_owner = %(owner)s, lease_expires_at = %(until)s, lease_generation = lease_generation + 1
WHERE id = (SELECT id FROM {task} WHERE id = %(task_id)s AND NOT (status = ANY(%(terminal)s))
              AND (lease_owner IS NULL OR lease_expires_at < %(now)s)
            FOR UPDATE SKIP LOCKED)
RETURNING {returning}
"""


def task_claim(*, task_id: uuid.UUID, owner: str | None = None, seconds: int | None = None) -> Lease | None:
    """Claim the lease of a non-terminal task that nobody holds (or whose lease expired) — or of
    a cancelled task a compensation is due for (:func:`compensation_due_q`) or whose receipt is
    still to be recorded (:func:`receipt_unsettled_q`).

    Increments the fencing token. Returns the :class:`Lease`, or None when another worker holds
    a live lease (or its transaction holds the row) or the task is terminal / gone. Call it outside
    any transaction, so that the claim commits by itself: a claim rolled back with a caller's
    transaction would give its fencing token out again.
    """
    owner = owner or worker_identity()
    seconds = seconds or settings.FAULTDESK["LEASE_SECONDS"]
    now = timezone.now()
    # The usual claim, in one statement: a task that is not terminal.
    with connection.cursor() as cursor:
        cursor.execute(_CLAIM_SQL.format(task=Task._meta.db_table, returning="lease_generation"),
                       {"owner": owner, "until": now + timedelta(seconds=seconds), "task_id": task_id,
                        "terminal": [str(s) for s in reducer.TERMINAL], "now": now})
        row = cursor.fetchone()
    if row is not None:
        return Lease(task_id=task_id, owner=owner, generation=row[0])
    return _claim_terminal(task_id, owner=owner, seconds=seconds, now=now)


def _claim_terminal(task_id: uuid.UUID, *, owner: str, seconds: int, now) -> Lease | None:
    """A terminal task is claimable only when a compensation is due for it, or its receipt is still
    to be recorded (cancelled after the outbox recorded the receipt on its rows)."""
    with transaction.atomic():
        task = (
            Task.objects.select_for_update(skip_locked=True)
            .filter(pk=task_id)
            .filter(compensation_due_q() | receipt_unsettled_q())
            .filter(lease_free_q(now))
            .first()
        )
        if task is None:
            return None
        task.lease_owner = owner
        task.lease_expires_at = now + timedelta(seconds=seconds)
        task.lease_generation += 1
        task.save(update_fields=["lease_owner", "lease_expires_at", "lease_generation"])
    return Lease(task_id=task.pk, owner=owner, generation=task.lease_generation)



def task_claim_read(*, task_id: uuid.UUID, related: tuple[str, ...] = ()) -> tuple[Lease, Task] | None:
    """:func:`task_claim` that also reads the task: returns the :class:`Lease` and the task as the
    claim left it (the latest version, which the claim locked), with the ``related`` rows cached
    (e.g. ``("device", "tenant", "requester")``) — the usual claim and the read in one statement —
    or None when :func:`task_claim` would return None. Like it, call it outside any transaction:
    the claim commits by itself, so a fencing token is given out once, whatever becomes of what
    the holder does next."""
    owner = worker_identity()
    seconds = settings.FAULTDESK["LEASE_SECONDS"]
    now = timezone.now()
    claimed = sql.written_rows(Task, _CLAIM_SQL.format(task=Task._meta.db_table, returning="*"), {
        "owner": owner, "until": now + timedelta(seconds=seconds), "task_id": task_id,
        "terminal": [str(s) for s in reducer.TERMINAL], "now": now}, related=related)
    if claimed:
        task = claimed[0]
        return Lease(task_id=task.pk, owner=owner, generation=task.lease_generation), task
    lease = _claim_terminal(task_id, owner=owner, seconds=seconds, now=now)
    if lease is None:
        return None
    task = sql.row(Task, "t0.id = %s", [task_id], related=related)
    return (lease, task) if task is not None else None


_RENEW_SQL = "UPDATE {task} SET lease_owner = %s, lease_expires_at = %s WHERE id = %s AND lease_generation = %s"


def task_lease_renew(*, lease: Lease, seconds: int | None = None) -> None:
    """Extend a lease we still hold (same fencing token) by ``seconds`` (default
    ``LEASE_SECONDS``) from now, before a long activity. Raises :class:`StaleWrite` when the lease
    passed to another worker."""
    seconds = seconds or settings.FAULTDESK["LEASE_SECONDS"]
    until = timezone.now() + timedelta(seconds=seconds)
    run = open_run()
    if run is not None and run.lease_change(lease.task_id, lease.generation, until=until, owner=lease.owner):
        return  # written with the row's next image: the run holds the row under this token
    with connection.cursor() as cursor:
        cursor.execute(_RENEW_SQL.format(task=Task._meta.db_table),
                       [lease.owner, until, lease.task_id, lease.generation])
        renewed = cursor.rowcount
    if not renewed:
        raise StaleWrite(f"task {lease.task_id}: lease {lease.generation} passed on; not renewed")


def task_release(*, lease: Lease) -> bool:
    """Give the lease back if it is still ours (same fencing token). Returns True if released
    (inside a run's transaction that holds the row under this token: with the row's last image,
    at the commit)."""
    run = open_run()
    if run is not None and run.lease_change(lease.task_id, lease.generation):
        return True
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {Task._meta.db_table} SET lease_owner = NULL, lease_expires_at = NULL "  # noqa: S608
                       "WHERE id = %s AND lease_generation = %s", [lease.task_id, lease.generation])
        return cursor.rowcount == 1
