"""Appending one event (and what follows it) to each of several tasks in one transaction (DESIGN.md
§4): the batched form of :func:`apps.tasks.store.task_append_with_retry` — the same δ, CAS, seq,
ledger, snapshot and projection rules, with one CAS ``UPDATE`` for all the tasks and one ``INSERT``
for all their events. The outbox records a batch's receipts with it."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.core import sql
from apps.core.digests import sha256_json
from apps.core.failpoints import failpoint
from apps.events.models import TaskEvent, TaskSnapshot
from apps.tasks import reducer
from apps.tasks.event_rows import events_insert_many, snapshots_insert_many
from apps.tasks.models import Task
from apps.tasks.store import (
    StaleWrite,
    projections_run,
    reduce_pinned,
    row_columns,
    state_digest,
)
from apps.tasks.usage import tenant_ledger_apply_many

#: the same logger as the store's: one "event.appended" line per committed event
events_log = structlog.get_logger("faultdesk.events")


@dataclass
class PreparedEvent:
    """One event for one task, reduced in memory and not written yet (:func:`task_events_prepare`):
    the task as locked and read, the event, and δ's new state — and the events that follow it in
    the same commit (``follow``: ``[(event_type, payload, state after it)]``, from the request's
    ``then``), ``new_state`` then being the state after the last of them."""

    task: Task
    event_type: str
    payload: dict
    actor: str
    new_state: dict
    follow: list[tuple[str, dict, dict]] = field(default_factory=list)
    #: the state after the first event (``new_state`` when nothing follows it)
    first_state: dict | None = None

    def chain(self) -> list[tuple[str, dict, dict]]:
        """``[(event_type, payload, state after it)]`` of every event of this task, in seq order."""
        return [(self.event_type, self.payload, self.first_state or self.new_state), *self.follow]


#: ``then(task, state) -> (event_type, payload) | None``: the event that follows a batched event of
#: ``task`` in the same commit, given the state after it (e.g. the completion after a receipt)
Then = Callable[[Task, dict], "tuple[str, dict] | None"]


def task_events_prepare(requests: list[tuple[uuid.UUID, str, Callable[[Task], dict], str]], *,
                        then: Then | None = None,
                        ) -> tuple[list[PreparedEvent], list[tuple[uuid.UUID, str, dict, str]]]:
    """The first half of appending one event to each of several tasks in one transaction
    (DESIGN.md §4; the batched form of :func:`task_append_with_retry`). ``requests`` is
    ``[(task_id, event_type, payload_fn, actor)]``, each task at most once.

    Inside the caller's transaction: locks the tasks (``SELECT … FOR UPDATE``, in id order, so two
    batches never deadlock), builds each payload from the freshly read task and applies δ in
    memory; a ``payload_fn`` that returns None says the task needs no event after all (it was
    settled meanwhile), and the task is left out. ``then``, when given, is asked after each event
    for one more event of that task, appended right after it in the same commit (δ applied to it
    too; one that δ refuses is left out, and the first event stands without it). Writes nothing.
    Returns ``(prepared, refused)``: ``refused`` lists ``(task_id, event_type, payload, reason)``
    for the events δ refuses (and ``payload`` None, reason "no such task", for a task that does
    not exist); the caller leaves them out of the batch and records them
    (:func:`task_append_with_retry` does). Raises ``ValueError`` when a task is named twice,
    ``TransactionManagementError`` outside a
    transaction."""
    if not transaction.get_connection().in_atomic_block:
        raise transaction.TransactionManagementError("task_events_prepare needs the caller's transaction")
    ids = [r[0] for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("one event per task in a batch")
    # FOR UPDATE OF the tasks only: the tenant is read, not locked.
    tasks = {t.pk: t for t in sql.rows(Task, "t0.id = ANY(%s)", [ids], related=("tenant",),
                                       tail="ORDER BY t0.id FOR UPDATE OF t0")}
    prepared, refused = [], []
    for task_id, event_type, payload_fn, actor in requests:
        task = tasks.get(task_id)
        if task is None:
            refused.append((task_id, event_type, None, "no such task"))
            continue
        payload = payload_fn(task)
        if payload is None:
            continue
        try:
            new_state = reduce_pinned(task, event_type, payload)
        except reducer.IllegalTransition as exc:
            refused.append((task_id, event_type, payload, exc.reason))
            continue
        item = PreparedEvent(task=task, event_type=event_type, payload=payload, actor=actor, new_state=new_state)
        following = then(task, new_state) if then is not None else None
        if following is not None:
            follow_type, follow_payload = following
            try:
                after = reduce_pinned(task, follow_type, follow_payload, state=new_state)
            except reducer.IllegalTransition:
                pass  # the first event stands alone; whoever acts next decides (and records) the rest
            else:
                item.first_state = new_state
                item.follow.append((follow_type, follow_payload, after))
                item.new_state = after
        prepared.append(item)
    return prepared, refused


_CAS_MANY_SQL = """
UPDATE {table} AS t SET version = v.expected + v.events, updated_at = %s, status = v.status,
    state = v.state::jsonb, termination_reason = v.reason, budget_total = v.total, budget_used = v.used,
    budget_reserved = v.reserved
FROM (VALUES {rows}) AS v(id, expected, events, status, state, reason, total, used, reserved)
WHERE t.id = v.id AND t.version = v.expected
"""
_CAS_ROW = "(%s::uuid, %s::integer, %s::integer, %s, %s, %s, %s::integer, %s::integer, %s::integer)"


def task_events_commit(prepared: list[PreparedEvent]) -> list[TaskEvent]:
    """The second half (see :func:`task_events_prepare`), in the same transaction: one CAS
    ``UPDATE`` for every task (``version = v + n WHERE version = v``, ``n`` its events), one
    ``INSERT`` for the events, the snapshots due, the tenant's ledger and the registered projections
    per event — what :func:`task_append_event` does for one. Returns the first event of each task,
    in ``prepared``'s order; the in-memory tasks follow their rows.

    Raises :class:`StaleWrite` when any CAS lost (the caller's transaction must roll back: none of
    the batch is applied) and :class:`~apps.tasks.usage.BudgetExceeded` from the ledger."""
    if not prepared:
        return []
    chains = [(p, p.chain()) for p in prepared]
    for _, chain in chains:
        for event_type, _, _ in chain:
            failpoint(f"before_commit:{event_type}")
    now = timezone.now()
    columns = [(p, row_columns(p.task, p.new_state)) for p in prepared]
    params: list = [now]
    for (p, c), (_, chain) in zip(columns, chains, strict=True):
        params += [str(p.task.pk), p.task.version, len(chain), c["status"], json.dumps(c["state"]),
                   c["termination_reason"], c["budget_total"], c["budget_used"], c["budget_reserved"]]
    statement = _CAS_MANY_SQL.format(table=Task._meta.db_table, rows=", ".join([_CAS_ROW] * len(prepared)))
    if not transaction.get_connection().in_atomic_block:
        raise transaction.TransactionManagementError("task_events_commit needs the caller's transaction")
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        if cursor.rowcount != len(prepared):
            raise StaleWrite(f"{len(prepared) - cursor.rowcount} of {len(prepared)} tasks moved past their version")
    events = [TaskEvent(id=uuid.uuid4(), task_id=p.task.pk, tenant_id=p.task.tenant_id, seq=p.task.version + 1 + i,
                        type=event_type, payload=payload, payload_digest=sha256_json(payload), occurred_at=now,
                        recorded_at=now, actor=p.actor, lease_generation=p.task.lease_generation)
              for p, chain in chains for i, (event_type, payload, _) in enumerate(chain)]
    events_insert_many(events)
    every = settings.FAULTDESK["SNAPSHOT_EVERY"]
    snapshots = [TaskSnapshot(task_id=p.task.pk, seq=p.task.version + 1 + i, state=state, digest=state_digest(state),
                              reducer_version=(p.task.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION))
                 for p, chain in chains for i, (_, _, state) in enumerate(chain)
                 if every and (p.task.version + 1 + i) % every == 0]
    snapshots_insert_many(snapshots, now=now)
    # The tenant's day row moves once per tenant and day, by the batch's sum.
    tenant_ledger_apply_many([(p.task, p.task.state, p.new_state) for p in prepared])
    written = iter(events)
    firsts = []
    for p, chain in chains:
        before = p.task
        for i, (event_type, _, state) in enumerate(chain):
            event = next(written)
            if i == 0:
                firsts.append(event)
            projections_run(before, event, state)
            events_log.info("event.appended", tenant_id=str(p.task.tenant_id), task_id=str(p.task.pk),
                            event_seq=event.seq, event_type=event_type, actor=p.actor, lease_generation=None,
                            status=state["status"])
            transaction.on_commit(lambda t=event_type: failpoint(f"after_commit:{t}"))
            # the task as read before the next event of the chain: the status this event left
            before = copy.copy(p.task)
            before.status, before.state = state["status"], state
    # The in-memory tasks follow their rows (a caller whose transaction rolls back drops them).
    for (p, c), (_, chain) in zip(columns, chains, strict=True):
        for name, value in c.items():
            setattr(p.task, name, value)
        p.task.version += len(chain)
    return firsts
