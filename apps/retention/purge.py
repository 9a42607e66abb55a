"""The purge: each tenant's retention policy enforced in short batches (DESIGN.md §13 "Retention";
spec agent-execution-system.md §16.2 and §16.12: keep references, versions and digests; keep
sensitive originals only as long as needed).

One run, started by beat (``purge_expired``) or ``manage.py purge``:

1. takes the purge lease (:class:`~apps.retention.models.PurgeLease`, for its time budget and a
   minute), so two runs never overlap (a second one returns at once);
2. for each tenant, and for rows that belong to no tenant, works through the steps below in
   batches of ``PURGE_BATCH`` rows, each its own short transaction that locks only rows no one else
   holds (``FOR UPDATE SKIP LOCKED``) and gives up on any other lock after ``PURGE_LOCK_TIMEOUT_MS``:
   - ``excerpts``: evidence excerpts out of finished tasks' state, events and snapshots;
   - ``payload``: finished tasks' event payloads, snapshots and report text (the event skeleton —
     type, seq, digest — stays; :func:`apps.tasks.replay.task_replay` reports such a task as purged);
   - with each task batch, in its transaction: the copies of evidence excerpts and free text in the
     task's decided approvals (:mod:`apps.approvals.retention`; the binding — h(a), status,
     decider, times — stays); ``approvals_payload``, ``approvals_excerpts`` catch up with the
     approvals a batch left (a row locked then, tasks purged before approvals were);
   - ``attempts``, ``outbox``, ``webhooks``: rows deleted;
   - ``attachments``: the stored files of payload-purged tasks deleted, their rows marked
     (:mod:`apps.attachments.retention`; a file an open delivery still sends stays);
   - ``notifications``: the free text of finished notifications emptied
     (:mod:`apps.notifications.retention`);
   - ``gateway_calls``: the records of outbound calls deleted (:mod:`apps.gateway.retention`; with the
     webhooks, also for rows of no tenant);
3. stops when nothing is left or its time budget (``PURGE_TIME_BUDGET_SECONDS``) is spent (the next
   run goes on), and records a :class:`~apps.retention.models.PurgeRun` with the rows and bytes per
   table.

The floors no policy can lower: nothing of an open task, or of a task with an unreconciled action,
is touched; a task's payloads, its actions' attempts and outbox rows, and the deduplication record
of a verified webhook are kept for the idempotency window (``IDEMPOTENCY_KEY_RETENTION_DAYS``, never
less than the task deadline + reconciliation window + restore window of ``apps.actions.checks``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from apps.accounts.models import Tenant
from apps.actions import retention as attempts
from apps.actions.checks import key_retention_needed_days
from apps.approvals import retention as approvals
from apps.attachments import retention as attachments
from apps.core.retention import PurgeCounts, Purged
from apps.events.retention import EXCERPTS, PAYLOAD
from apps.gateway import retention as gateway_calls
from apps.notifications import retention as notifications
from apps.outbox import retention as outbox
from apps.retention.models import DAY_FIELDS, PurgeRun, RetentionPolicy
from apps.tasks import reducer
from apps.tasks import retention as tasks
from apps.tickets import retention as webhooks

log = logging.getLogger(__name__)

#: how long past its time budget a run's lease lasts (a batch in flight, the records written)
LEASE_MARGIN_SECONDS = 60
#: purge runs are kept this long
RUNS_KEPT_DAYS = 90


@dataclass(frozen=True)
class Cutoffs:
    """For one tenant at one moment: before when each kind of row may go, and ``keys`` — the
    idempotency window's start, before which an action's rows may go."""

    excerpts: datetime
    payloads: datetime
    webhooks: datetime
    attempts: datetime
    outbox: datetime
    notifications: datetime
    gateway_calls: datetime
    keys: datetime


def policy_days(policy: RetentionPolicy | None) -> dict[str, int]:
    """The days of each field of ``policy`` (None: no policy row), the installation's default
    (``FAULTDESK["RETENTION"]``) where it is empty."""
    defaults = settings.FAULTDESK["RETENTION"]
    return {f: (getattr(policy, f, None) or defaults[f]) for f in DAY_FIELDS}


def key_window_days() -> float:
    """The idempotency window in days: the configured key retention, and never less than what
    ``apps.actions.checks`` says a key can still be used for."""
    conf = settings.FAULTDESK
    return max(conf["IDEMPOTENCY_KEY_RETENTION_DAYS"], key_retention_needed_days(conf))


def cutoffs_for(policy: RetentionPolicy | None, now: datetime) -> Cutoffs:
    """The :class:`Cutoffs` of a tenant with ``policy`` at ``now``."""
    days = policy_days(policy)
    return Cutoffs(**{f.removesuffix("_days"): now - timedelta(days=d) for f, d in days.items()},
                   keys=now - timedelta(days=key_window_days()))


@dataclass
class _Tally:
    counts: PurgeCounts = field(default_factory=PurgeCounts)
    tasks: dict[str, int] = field(default_factory=lambda: {EXCERPTS: 0, PAYLOAD: 0})
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass
class _Run:
    deadline: float
    batch: int
    tallies: dict[int | None, _Tally] = field(default_factory=dict)
    complete: bool = True

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.deadline


@dataclass
class PurgeSummary:
    """What :func:`purge_run` did, over every tenant: ``tasks`` purged per level, ``tables``
    (table -> ``{"rows", "bytes"}``), ``skipped`` batches per step, ``complete`` (it reached the
    end of what was eligible), and the :class:`PurgeRun` rows it recorded."""

    started_at: datetime
    finished_at: datetime
    complete: bool
    tasks: dict[str, int]
    tables: dict[str, dict[str, int]]
    skipped: dict[str, int]
    records: list[PurgeRun]


def _batched(run: _Run, tally: _Tally, step: str, table: str | None,
             batch_fn: Callable[[], tuple[int, PurgeCounts | Purged]]):
    """Call ``batch_fn`` until it purges nothing or the run is out of time. Each call runs in its
    own transaction with a lock timeout; a batch that meets a lock is counted in ``skipped`` and the
    step moves on (the next run tries again)."""
    lock_ms = int(settings.FAULTDESK["PURGE_LOCK_TIMEOUT_MS"])
    while True:
        if run.out_of_time():
            run.complete = False
            return
        try:
            with transaction.atomic():
                with connection.cursor() as cur:
                    cur.execute("SELECT set_config('lock_timeout', %s, true)", [f"{lock_ms}ms"])
                n, done = batch_fn()
        except DatabaseError as exc:  # a lock timeout (or a statement cancelled): leave it for the next run
            log.warning("purge step %s gave up a batch: %s", step, exc)
            tally.skipped[step] = tally.skipped.get(step, 0) + 1
            run.complete = False
            return
        if isinstance(done, PurgeCounts):
            tally.counts.merge(done)
        elif table is not None and done.rows:
            tally.counts.add(table, done)
        if n == 0:
            return
        if step in tally.tasks:
            tally.tasks[step] += n
        if n < run.batch:
            return


def _tenant_steps(run: _Run, tenant_id: int | None, cut: Cutoffs, at: datetime) -> None:
    from apps.actions.models import ActionAttempt
    from apps.approvals.models import ApprovalRequest
    from apps.gateway.models import GatewayCall
    from apps.notifications.models import Notification
    from apps.outbox.models import OutboxMessage
    from apps.tickets.models import InboundWebhook

    b = run.batch
    tally = run.tallies.setdefault(tenant_id, _Tally())
    if tenant_id is not None:
        # the payload level first: it takes the excerpts with it, so a task past both is rewritten once
        for level, before in ((PAYLOAD, cut.payloads), (EXCERPTS, cut.excerpts)):
            keys_before = cut.keys if level == PAYLOAD else None
            # a decided approval's copies go with its task, in the task's batch
            _batched(run, tally, level, None, lambda level=level, before=before, keys_before=keys_before:
                     tasks.purge_task_batch(tenant_id, level, before=before, keys_before=keys_before, limit=b, at=at,
                                            also=lambda ids, level=level: approvals.purge_task_approvals(
                                                ids, level, at=at)))
        # the approvals a task's batch left (locked then, or of tasks purged before approvals were)
        for level in (PAYLOAD, EXCERPTS):
            _batched(run, tally, f"approvals_{level}", ApprovalRequest._meta.db_table, lambda level=level: _rows(
                approvals.purge_approvals_batch(tenant_id, level, limit=b, at=at)))
        finished = sorted(reducer.TERMINAL)
        _batched(run, tally, "attempts", ActionAttempt._meta.db_table, lambda: _rows(attempts.purge_attempts_batch(
            tenant_id, before=cut.attempts, keys_before=cut.keys, task_statuses=finished, limit=b)))
        _batched(run, tally, "outbox", OutboxMessage._meta.db_table, lambda: _rows(outbox.purge_messages_batch(
            tenant_id, before=cut.outbox, keys_before=cut.keys, task_statuses=finished, limit=b)))
        # a purged payload takes the report's files with it (an open delivery keeps them)
        _batched(run, tally, "attachments", None, lambda: attachments.purge_attachments_batch(
            tenant_id, task_statuses=finished, limit=b, at=at))
        _batched(run, tally, "notifications", Notification._meta.db_table, lambda: _rows(
            notifications.purge_notifications_batch(tenant_id, before=cut.notifications, task_statuses=finished,
                                                    limit=b, at=at)))
    _batched(run, tally, "webhooks", InboundWebhook._meta.db_table, lambda: _rows(webhooks.purge_webhooks_batch(
        tenant_id, before=cut.webhooks, keys_before=cut.keys, limit=b)))
    _batched(run, tally, "gateway_calls", GatewayCall._meta.db_table, lambda: _rows(
        gateway_calls.purge_calls_batch(tenant_id, before=cut.gateway_calls, limit=b)))


def _rows(purged: Purged) -> tuple[int, Purged]:
    return purged.rows, purged


#: the one row that says which run holds the purge until when (created by the app's migration 0002,
#: a table without a model: it belongs to no tenant, and nothing but this module reads it). A row,
#: not a PostgreSQL advisory lock: a session lock would outlive its run on a pooled connection.
LEASE_TABLE = "retention_purge_lease"


def _lease_take(holder: str, until: datetime) -> bool:
    table = LEASE_TABLE
    with connection.cursor() as cur:
        cur.execute(f"INSERT INTO {table} (id, holder, expires_at) VALUES (1, %s, %s) "  # noqa: S608 - our table
                    f"ON CONFLICT (id) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at "
                    f"WHERE {table}.expires_at < clock_timestamp() RETURNING holder", [holder, until])
        return cur.fetchone() is not None


def _lease_give_back(holder: str) -> None:
    with connection.cursor() as cur:
        cur.execute(f"UPDATE {LEASE_TABLE} SET expires_at = '-infinity' WHERE id = 1 AND holder = %s",  # noqa: S608
                    [holder])


def _record(run: _Run, started: datetime, now: datetime, *, failed: bool = False) -> list[PurgeRun]:
    """One :class:`PurgeRun` per tenant the run purged something of (or all it touched, when it
    stopped early); ``failed`` marks a run that raised (``skipped["error"]``)."""
    finished = timezone.now()
    PurgeRun.objects.filter(started_at__lt=now - timedelta(days=RUNS_KEPT_DAYS)).delete()
    return [PurgeRun.objects.create(tenant_id=tenant_id, started_at=started, finished_at=finished,
                                    complete=run.complete, tasks=t.tasks, tables=t.counts.as_dict(),
                                    skipped={**t.skipped, **({"error": 1} if failed else {})})
            for tenant_id, t in run.tallies.items()
            if t.counts.tables or t.skipped or any(t.tasks.values()) or not run.complete]


def purge_run(*, now: datetime | None = None, time_budget_seconds: float | None = None,
              batch_size: int | None = None, tenant_ids: list[int] | None = None) -> PurgeSummary | None:
    """Run the purge once (see the module docstring). ``now`` moves the clock (tests, the bench);
    ``tenant_ids`` narrows it to those tenants (and leaves rows with no tenant alone). Returns a
    :class:`PurgeSummary`, or None when another run holds the purge lease."""
    conf = settings.FAULTDESK
    now = now or timezone.now()
    budget = conf["PURGE_TIME_BUDGET_SECONDS"] if time_budget_seconds is None else time_budget_seconds
    holder = uuid.uuid4().hex
    if not _lease_take(holder, timezone.now() + timedelta(seconds=budget + LEASE_MARGIN_SECONDS)):
        return None
    run = _Run(deadline=time.monotonic() + budget, batch=batch_size or conf["PURGE_BATCH"])
    started = timezone.now()
    records: list[PurgeRun] = []
    try:
        policies = {p.tenant_id: p for p in RetentionPolicy.objects.all()}
        ids = tenant_ids if tenant_ids is not None else list(Tenant.objects.order_by("pk").values_list("pk", flat=True))
        for tenant_id in ids:
            _tenant_steps(run, tenant_id, cutoffs_for(policies.get(tenant_id), now), now)
        if tenant_ids is None:
            _tenant_steps(run, None, cutoffs_for(None, now), now)
    except Exception:
        # what the batches before the failure purged is committed: record it, then let it raise
        run.complete = False
        _record(run, started, now, failed=True)
        raise
    else:
        records = _record(run, started, now)
    finally:
        _lease_give_back(holder)
    finished = records[0].finished_at if records else timezone.now()
    total, tasks, skipped = PurgeCounts(), {EXCERPTS: 0, PAYLOAD: 0}, {}
    for t in run.tallies.values():
        total.merge(t.counts)
        for k, v in t.tasks.items():
            tasks[k] += v
        for k, v in t.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
    summary = PurgeSummary(started, finished, run.complete, tasks, total.as_dict(), skipped, records)
    log.info("purge run: %s tasks, %s", tasks, summary.tables)
    return summary
