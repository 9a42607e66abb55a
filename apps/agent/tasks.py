"""Celery tasks of the agent runtime: thin wrappers (ids in, call the runner). Nobody imports them
to enqueue: work is sent by task name through :func:`apps.core.queue.enqueue_on_commit`, which
defers to ``transaction.on_commit`` so a message is never sent for a row that is not committed."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from celery import shared_task
from django.db import DatabaseError
from django.utils import timezone

from apps.core import queue
from config.database import retryable

log = logging.getLogger(__name__)


#: Retries of a step the database refused with a retryable error, and the first delay (seconds).
DATABASE_RETRIES, DATABASE_RETRY_DELAY = 5, 1.0


def _retrying_database_refusals(task, step) -> None:
    """Run ``step()``; when PostgreSQL refuses it retryably (a lock or statement timeout, a
    session ended idle in its transaction, a serialization failure or deadlock:
    :func:`config.database.retryable`) the step ran in a transaction that rolled back, so the Celery
    task is retried with a growing delay. After the last retry the lease sweeper brings it back."""
    from apps.tasks.usage import TenantQuotaRace

    try:
        step()
    except (DatabaseError, TenantQuotaRace) as exc:
        # a run whose admitted reservations no longer fit the tenant's quota at its commit rolled
        # back whole: tried again, its reservation is refused with the reason
        why = "tenant quota race" if isinstance(exc, TenantQuotaRace) else retryable(exc)
        if why is None or task.request.retries >= DATABASE_RETRIES:
            raise
        log.warning("%s refused by the database (%s): retry %d", task.name, why, task.request.retries + 1)
        raise task.retry(exc=exc, countdown=DATABASE_RETRY_DELAY * 2 ** task.request.retries) from exc


@shared_task(name=queue.AGENT_STEP, bind=True)
def agent_step(self, task_id: str) -> None:
    from apps.agent.runner import agent_run

    _retrying_database_refusals(self, lambda: agent_run(task_id=uuid.UUID(task_id)))


@shared_task(name=queue.READ_CONTEXT, bind=True)
def read_context(self, task_id: str) -> None:
    from apps.agent.runner import context_read

    _retrying_database_refusals(self, lambda: context_read(task_id=uuid.UUID(task_id)))


@shared_task(name=queue.READ_STEP, bind=True)
def read_step(self, task_id: str, activity_id: str) -> None:
    from apps.agent.runner import read_activity_run

    _retrying_database_refusals(self, lambda: read_activity_run(task_id=uuid.UUID(task_id), activity_id=activity_id))


#: messages one sweep sends at most (the rest wait for the next tick, 5 s later)
SWEEP_SENDS_PER_TICK = 200


@shared_task(name=queue.SWEEP_LEASES)
def sweep_leases() -> int:
    """Beat: re-queue work that is runnable but idle — a lease that expired (its worker died) or
    a runnable task nobody has touched for a while (a lost broker message, or one still queued
    behind a backlog: so each task is re-queued at most once per ``SWEEPER_REQUEUE_SECONDS``).
    Returns the count of tasks found plus reservations settled."""
    from django.conf import settings

    from apps.agent.sweeper import tasks_needing_work, tasks_with_orphaned_reservations
    from apps.tasks.budget import orphaned_reservations_settle

    now = timezone.now()
    idle = timedelta(seconds=settings.FAULTDESK["SWEEPER_IDLE_SECONDS"])
    ids = tasks_needing_work(now=now, idle=idle)
    # at most half a lease: a worker that died on a re-queued task waits at most that long more
    every = min(settings.FAULTDESK.get("SWEEPER_REQUEUE_SECONDS", 0), settings.FAULTDESK["LEASE_SECONDS"] / 2)
    sent = 0
    for status, task_id in ids:
        # the context reads run on the tools pool, and ACCEPTED's next step is to start them
        name = queue.READ_CONTEXT if status in ("ACCEPTED", "RETRIEVING") else queue.AGENT_STEP
        # the tasks re-queued within the window are passed over, so a tick reaches past them
        sent += queue.send_at_most_every(name, task_id, seconds=every)
        if sent >= SWEEP_SENDS_PER_TICK:
            break
    settled = 0
    for task_id in tasks_with_orphaned_reservations(now=now):
        try:
            settled += orphaned_reservations_settle(task_id=uuid.UUID(task_id))
        except Exception:  # noqa: BLE001 - one task's trouble must not stop the sweep; retried next tick
            log.exception("could not settle the orphaned reservations of %s", task_id)
    return len(ids) + settled
