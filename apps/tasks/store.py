"""The task aggregate's commit path (DESIGN.md §4, §5; spec §16.3 "并发恢复版本约束").

Commit = ``UPDATE task SET … , version = v + 1 WHERE id = ? AND version = v [AND lease_generation
= g]`` plus the event insert, in one transaction. Zero rows updated means the writer lost: it
re-reads, it never overwrites. An event δ refuses, or a write that lost, is recorded as a
:class:`~apps.events.models.RefusedEvent`, never applied.

Other apps keep their rows in step with the task through *projections*: a function registered with
:func:`projection_register` (from the app's ``AppConfig.ready``) runs inside every event's
transaction, so the task never needs to know their models (the approvals app closes its pending
requests when a task is cancelled or ends).

The events of one run commit together at its checkpoints (:mod:`apps.tasks.runs`); one event for
each of several tasks commits in one transaction with :mod:`apps.tasks.batch`.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import uuid
from collections.abc import Callable

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.core import sql
from apps.core.digests import sha256_json
from apps.core.failpoints import failpoint
from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.runs import event_transaction, open_run
from apps.tasks.usage import tenant_ledger_apply, tenant_ledger_moves

#: one structured line per committed event (config.logs): tenant, task, seq, type, actor, fencing token
events_log = structlog.get_logger("faultdesk.events")

#: ``fn(task, event, new_state)`` run inside each event's transaction, after the event's own
#: ``side_effects``; ``task`` is the task as read before the event (its old status). Registered by
#: other apps in ``ready()``; what they raise rolls the event back.
Projection = Callable[[Task, TaskEvent, dict], None]
_PROJECTIONS: list[Projection] = []


def projection_register(fn: Projection) -> Projection:
    """Register ``fn`` to run inside every task event's transaction (see :data:`Projection`).
    Registering the same function twice keeps one. Returns ``fn`` (usable as a decorator)."""
    if fn not in _PROJECTIONS:
        _PROJECTIONS.append(fn)
    return fn


def projections_run(task: Task, event: TaskEvent, new_state: dict) -> None:
    """Run the registered projections for ``event`` (``task`` as read before it, ``new_state`` after
    it), inside the event's transaction."""
    for project in _PROJECTIONS:
        project(task, event, new_state)


class StaleWrite(Exception):
    """The CAS lost: the task moved past ``expected_version`` or the lease passed to another
    worker (fencing token ``lease_generation`` no longer current)."""


def worker_identity() -> str:
    """``host:pid`` of this process — the lease owner string."""
    return f"{socket.gethostname()}:{os.getpid()}"


def state_digest(state: dict) -> str:
    return sha256_json(state)


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, marked with "…" when cut (the full text stays in
    the event)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def row_columns(task: Task, new_state: dict) -> dict:
    """Columns of the materialized state derived from the reducer state."""
    b = new_state["budget"]
    return {
        "status": new_state["status"],
        "state": new_state,
        "termination_reason": _cut(new_state.get("termination_reason") or "", 300),
        "budget_total": b["total"],
        "budget_used": b["used"],
        "budget_reserved": b["reserved"],
    }


def reduce_pinned(task: Task, event_type: str, payload: dict, *, state: dict | None = None) -> dict:
    """δ of the reducer pinned in ``task``'s artifact bundle applied to its state (or to ``state``,
    a later state of ``task`` not yet written). Raises :class:`reducer.IllegalTransition` when δ
    refuses the event or the pinned reducer is unknown."""
    try:
        reduce = reducer.reducer_for((task.artifact_bundle or {}).get("reducer"))
    except reducer.UnknownReducer as exc:
        raise reducer.IllegalTransition(task.status, event_type, str(exc)) from exc
    return reduce(task.state if state is None else state, event_type, payload)


def task_append_event(
    *,
    task: Task,
    event_type: str,
    payload: dict,
    actor: str,
    lease_generation: int | None = None,
    causation_id: uuid.UUID | None = None,
    occurred_at=None,
    side_effects: Callable[[Task, TaskEvent], None] | None = None,
) -> Task:
    """Apply δ to ``task`` (as read, at ``task.version``) and commit the event with CAS.

    When ``lease_generation`` is given, the commit also requires the task's fencing token to be
    still ``lease_generation`` (only the lease holder may commit). ``side_effects(task, event)``
    runs inside the same transaction (approval rows, action + outbox rows, ...).

    Returns the updated task. Raises :class:`reducer.IllegalTransition` when δ refuses the event
    and :class:`StaleWrite` when the CAS loses (version moved or fencing token superseded); both
    are first recorded as a :class:`RefusedEvent`, never applied.
    """
    try:
        new_state = reduce_pinned(task, event_type, payload)
    except reducer.IllegalTransition as exc:
        refused_event_record(task=task, event_type=event_type, payload=payload, reason=exc.reason, actor=actor,
                             lease_generation=lease_generation)
        raise
    expected = task.version
    now = timezone.now()
    failpoint(f"before_commit:{event_type}")
    columns = row_columns(task, new_state)
    try:
        with event_transaction() as lean:
            _write_event(task, new_state, columns, lean=lean, expected=expected, lease_generation=lease_generation,
                         now=now, event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                         occurred_at=occurred_at or now, side_effects=side_effects)
    except StaleWrite:
        refused_event_record(task=task, event_type=event_type, payload=payload,
                             reason=_stale_reason(task.pk, expected, lease_generation), actor=actor,
                             lease_generation=lease_generation)
        raise
    line = {"tenant_id": str(task.tenant_id), "task_id": str(task.pk), "event_seq": expected + 1,
            "event_type": event_type, "actor": actor, "lease_generation": lease_generation,
            "status": new_state["status"]}
    run = open_run()
    held = run.held(task.pk, lease_generation) if run is not None else None
    if held is not None:
        held.task = task
        run.log_at_commit(line)
    else:
        events_log.info("event.appended", **line)
    # The in-memory task follows the row (and, in a run, the run's transaction).
    for name, value in columns.items():
        setattr(task, name, value)
    task.version = expected + 1
    _after_commit_failpoint(event_type)
    return task


def _after_commit_failpoint(event_type: str) -> None:
    """The ``after_commit:<event_type>`` failpoint, after the outermost commit: inside a caller's
    transaction (a receipt recorded with its action and outbox rows) it waits for that commit."""
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: failpoint(f"after_commit:{event_type}"))
    else:
        failpoint(f"after_commit:{event_type}")


def _snapshot_if_due(task: Task, seq: int, new_state: dict) -> None:
    """Write the snapshot of ``new_state`` at ``seq`` when ``seq`` is a multiple of
    ``FAULTDESK["SNAPSHOT_EVERY"]`` (0: never), in the event's transaction."""
    every = settings.FAULTDESK["SNAPSHOT_EVERY"]
    if every and seq % every == 0:
        TaskSnapshot.objects.create(
            task_id=task.pk, seq=seq, state=new_state, digest=state_digest(new_state),
            reducer_version=(task.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION))


_CREATE_SQL = """
WITH t AS ({insert} RETURNING id)
INSERT INTO {event} (id, task_id, tenant_id, seq, type, payload, payload_digest, occurred_at, recorded_at,
                     causation_id, actor, lease_generation)
SELECT %s, t.id, %s, 1, %s, %s::jsonb, %s, %s, %s, NULL, %s, %s FROM t
"""


def task_create(*, task: Task, event_type: str, payload: dict, actor: str, occurred_at=None) -> Task:
    """Write the new task ``task`` — built with ``Task(...)``, not saved, at version 0 with the
    reducer's initial state — together with its first event, in one statement of the caller's
    transaction: the row as δ leaves it at version 1 and the event at seq 1 (what
    :func:`apps.core.sql.insert` then :func:`task_append_event` would write, in two statements
    and a savepoint). The snapshot when one is due, the projections, the event's log line and its
    failpoints are as :func:`task_append_event`'s; an event that moves the tenant's day row is
    written that way instead. Returns ``task``, updated. Raises :class:`reducer.IllegalTransition`
    when δ refuses the event (nothing written: there is no row to record the refusal on) and what
    the database raises (``IntegrityError`` for a unique request key already taken)."""
    new_state = reduce_pinned(task, event_type, payload)
    if "limits" in new_state and tenant_ledger_moves(task.state, new_state):
        sql.insert(task)
        return task_append_event(task=task, event_type=event_type, payload=payload, actor=actor,
                                 occurred_at=occurred_at)
    now = timezone.now()
    failpoint(f"before_commit:{event_type}")
    before = copy.copy(task)  # the projections see the task as it was before the event
    for name, value in row_columns(task, new_state).items():
        setattr(task, name, value)
    task.version = 1
    event, params = _new_event(task, expected=0, lease_generation=None, now=now, event_type=event_type,
                               payload=payload, actor=actor, causation_id=None, occurred_at=occurred_at or now)
    insert, values = sql.insert_statement(task)
    # No savepoint of its own inside the caller's transaction: a failure here fails the caller's.
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute(_CREATE_SQL.format(insert=insert, event=TaskEvent._meta.db_table), [
            *values, event.id, task.tenant_id, event_type, params["payload"], event.payload_digest,
            event.occurred_at, now, actor, event.lease_generation])
        task._state.adding, task._state.db = False, connection.alias
        event._state.adding, event._state.db = False, connection.alias
        _snapshot_if_due(task, 1, new_state)
        projections_run(before, event, new_state)
    events_log.info("event.appended", tenant_id=str(task.tenant_id), task_id=str(task.pk), event_seq=1,
                    event_type=event_type, actor=actor, lease_generation=None, status=new_state["status"])
    _after_commit_failpoint(event_type)
    return task


def _write_event(task: Task, new_state: dict, columns: dict, *, lean: bool, expected: int,
                 lease_generation: int | None, now, event_type: str, payload: dict, actor: str, causation_id,
                 occurred_at, side_effects) -> TaskEvent:
    """The writes of one event (:func:`task_append_event`). With no savepoint (``lean``: in a run's
    own transaction) the event refuses before it writes: the tenant's quota is admitted against the
    run's ledger buffer (:class:`~apps.tasks.usage.BudgetExceeded`), then the CAS and the event's
    insert (:class:`StaleWrite` when it matched nothing), then the snapshot, the side effects and the
    projections, whose failure marks the transaction for rollback. In a savepoint the tenant's day
    row moves right after the CAS, and a quota refusal rolls the savepoint back.

    When ``lean`` with a fencing token, the row's image and the event are left to the run, which
    writes them once (:class:`~apps.tasks.runs.RunTransaction`: the events of a commit in one
    ``INSERT``, the row in one ``UPDATE``, before any statement on the task or event tables and
    before the commit). The run's first event on the row takes its lock under the CAS's conditions
    without writing it (:func:`_lock_for_run`); the next ones need no statement — nobody else can
    have moved the row. Returns the event."""
    run = open_run()
    if run is not None and not lean:
        # A write inside a nested transaction of the run: the row is brought up to date and the run
        # stops vouching for it (the nested transaction may still roll this event back).
        run.release_hold(task.pk)
    run = run if lean else None
    held = run.held(task.pk, lease_generation) if run is not None else None
    if held is not None and held.version != expected:
        raise StaleWrite(f"task {task.pk}: expected version {expected}, the run holds it at {held.version}")
    moves = "limits" in new_state and tenant_ledger_moves(task.state, new_state)
    if moves and run is not None:
        run.ledger.admit(task, task.state, new_state)  # BudgetExceeded: nothing written
    if held is not None:
        event = _event_deferred(run, task, expected=expected, lease_generation=lease_generation, now=now,
                                event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                                occurred_at=occurred_at)
        held.version, held.columns, held.now = expected + 1, columns, now
    elif run is not None and lease_generation is not None:
        # The run's first event on this row in this transaction: lock the row under the CAS's
        # conditions (StaleWrite when it moved); its image and the events are written later, once.
        _lock_for_run(task.pk, expected=expected, lease_generation=lease_generation)
        run.hold(task.pk, version=expected + 1, generation=lease_generation, written=expected, columns=columns,
                 now=now)
        event = _event_deferred(run, task, expected=expected, lease_generation=lease_generation, now=now,
                                event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                                occurred_at=occurred_at)
    else:
        event = _cas_and_insert(task, columns, expected=expected, lease_generation=lease_generation, now=now,
                                event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                                occurred_at=occurred_at)
        if run is not None:
            run.hold(task.pk, version=expected + 1, generation=lease_generation)
    if moves and run is not None:
        run.ledger.add(task, task.state, new_state)  # the day row moves once, at the commit
    try:
        if moves and run is None:
            # In its own savepoint: BudgetExceeded rolls the event back with it.
            tenant_ledger_apply(task, task.state, new_state)
        _snapshot_if_due(task, expected + 1, new_state)
        if side_effects is not None:
            side_effects(task, event)
        projections_run(task, event, new_state)
    except BaseException:
        if lean:
            transaction.set_rollback(True)  # the event is written: only the whole transaction can undo it
        raise
    return event


def _new_event(task: Task, *, expected: int, lease_generation: int | None, now, event_type: str, payload: dict,
               actor: str, causation_id, occurred_at) -> tuple[TaskEvent, dict]:
    """The event at ``seq = expected + 1`` as it will be written, and its statement parameters."""
    generation = lease_generation if lease_generation is not None else task.lease_generation
    event = TaskEvent(id=uuid.uuid4(), task_id=task.pk, tenant_id=task.tenant_id, seq=expected + 1, type=event_type,
                      payload=payload, payload_digest=sha256_json(payload), occurred_at=occurred_at, recorded_at=now,
                      causation_id=causation_id, actor=actor, lease_generation=generation)
    params = {"event_id": event.id, "task_id": task.pk, "tenant_id": task.tenant_id, "seq": expected + 1,
              "type": event_type, "payload": json.dumps(payload), "digest": event.payload_digest,
              "occurred_at": occurred_at, "now": now, "causation_id": causation_id, "actor": actor,
              "event_generation": generation}
    return event, params


def _event_deferred(run, task: Task, *, expected: int, lease_generation: int | None, now, event_type: str,
                    payload: dict, actor: str, causation_id, occurred_at) -> TaskEvent:
    """The event at ``seq = expected + 1``, handed to ``run`` to insert with the others of its
    transaction (the run holds the task row; see :func:`_write_event`)."""
    generation = lease_generation if lease_generation is not None else task.lease_generation
    event = TaskEvent(id=uuid.uuid4(), task_id=task.pk, tenant_id=task.tenant_id, seq=expected + 1, type=event_type,
                      payload=payload, payload_digest=sha256_json(payload), occurred_at=occurred_at, recorded_at=now,
                      causation_id=causation_id, actor=actor, lease_generation=generation)
    run.defer_event(event)
    return event


_LOCK_SQL = """
SELECT 1 FROM {task} WHERE id = %s AND version = %s AND lease_generation = %s FOR NO KEY UPDATE
"""


def _lock_for_run(task_id, *, expected: int, lease_generation: int) -> None:
    """The CAS of a run's first event in its transaction, without a write: lock the task row (as
    the CAS's ``UPDATE`` would: ``FOR NO KEY UPDATE``, which foreign-key checks do not wait for)
    while it stands at version ``expected`` under fencing token ``lease_generation``. Raises
    :class:`StaleWrite` when it does not."""
    with connection.cursor() as cursor:
        cursor.execute(_LOCK_SQL.format(task=Task._meta.db_table), [task_id, expected, lease_generation])
        if cursor.fetchone() is None:
            raise StaleWrite(f"task {task_id}: expected version {expected}, generation {lease_generation}")


_APPEND_SQL = """
WITH cas AS (
    UPDATE {task} SET version = %(seq)s, updated_at = %(now)s, status = %(status)s, state = %(state)s::jsonb,
        termination_reason = %(reason)s, budget_total = %(total)s, budget_used = %(used)s,
        budget_reserved = %(reserved)s
    WHERE id = %(task_id)s AND version = %(expected)s AND purged = %(purged)s {fence}
    RETURNING id)
INSERT INTO {event} (id, task_id, tenant_id, seq, type, payload, payload_digest, occurred_at, recorded_at,
                     causation_id, actor, lease_generation)
SELECT %(event_id)s, cas.id, %(tenant_id)s, %(seq)s, %(type)s, %(payload)s::jsonb, %(digest)s, %(occurred_at)s,
       %(now)s, %(causation_id)s, %(actor)s, %(event_generation)s
FROM cas
"""


def _cas_and_insert(task: Task, columns: dict, *, expected: int, lease_generation: int | None, now, event_type: str,
                    payload: dict, actor: str, causation_id, occurred_at) -> TaskEvent:
    """The commit of one event in one statement: the CAS ``UPDATE`` of the task row (``version =
    expected``, and the fencing token when ``lease_generation`` is given) and, only when it
    matched, the event's ``INSERT`` at ``seq = expected + 1``. Returns the event (as written);
    raises :class:`StaleWrite` when the CAS matched no row."""
    event, params = _new_event(task, expected=expected, lease_generation=lease_generation, now=now,
                               event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                               occurred_at=occurred_at)
    statement = _APPEND_SQL.format(task=Task._meta.db_table, event=TaskEvent._meta.db_table,
                                   fence="AND lease_generation = %(fence)s" if lease_generation is not None else "")
    with connection.cursor() as cursor:
        cursor.execute(statement, {
            **params, "expected": expected, "fence": lease_generation, "seq": expected + 1,
            # retention rewrites a finished task's state without an event (apps/tasks/retention.py): a
            # writer that read the task before the purge loses here, re-reads and writes on the purged state
            "purged": task.purged,
            "status": str(columns["status"]), "state": json.dumps(columns["state"]),
            "reason": columns["termination_reason"], "total": columns["budget_total"],
            "used": columns["budget_used"], "reserved": columns["budget_reserved"],
        })
        if cursor.rowcount != 1:
            raise StaleWrite(f"task {task.pk}: expected version {expected}, generation {lease_generation}")
    event._state.adding, event._state.db = False, connection.alias
    return event


def _stale_reason(task_id, expected: int, generation: int | None) -> str:
    row = Task.objects.filter(pk=task_id).values("version", "lease_generation").first() or {}
    if generation is not None and row.get("lease_generation") != generation:
        return (f"stale write: lease lost (fencing token {generation}, current {row.get('lease_generation')}); "
                "not applied")
    return f"stale write: version moved ({expected} expected, now {row.get('version')}); not applied"


def refused_event_record(*, task: Task, event_type: str, payload: dict, reason: str, actor: str,
                         lease_generation: int | None = None) -> RefusedEvent:
    """Record an event δ refused (DESIGN.md §4: late or illegal events are recorded, never
    applied). A caller whose own transaction rolls back after a refusal records it again after
    the rollback, so the record is not lost with it."""
    return RefusedEvent.objects.create(
        task_id=task.pk, tenant_id=task.tenant_id, at_version=task.version, type=event_type, payload=payload,
        reason=reason[:300], actor=actor, lease_generation=lease_generation,
    )


def refused_after_rollback(*, task_id: uuid.UUID, event_type: str, payload: dict, reason: str, actor: str,
                           lease_generation: int | None = None) -> RefusedEvent | None:
    """Record again, after a rollback, an event δ refused (or a write that lost) inside a caller's
    transaction: the rollback took :func:`task_append_event`'s own record with it, and the record
    of what was refused must not be lost (DESIGN.md §4). Reads the task fresh (its version now);
    None when the task is gone."""
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        return None
    return refused_event_record(task=task, event_type=event_type, payload=payload, reason=reason, actor=actor,
                                lease_generation=lease_generation)


def task_append_with_retry(
    *, task_id: uuid.UUID, event_type: str, payload_fn: Callable[[Task], dict], actor: str, attempts: int = 5,
    side_effects: Callable[[Task, TaskEvent], None] | None = None,
) -> Task:
    """Append an event that does not need the lease (a person's decision, a cancel, a receipt).
    The task row is locked (``SELECT … FOR UPDATE``) and read fresh, so the CAS cannot lose to
    the ledger's writers, which lock the same row; ``attempts`` only guards against the
    unexpected. ``payload_fn(task)`` builds the payload from the freshly read task.

    Raises :class:`reducer.IllegalTransition` (recorded as refused, also when this function's
    savepoint rolled the first record back) and :class:`StaleWrite` if every attempt lost."""
    for _ in range(attempts):
        try:
            with transaction.atomic():
                task = Task.objects.select_for_update().get(pk=task_id)
                payload = payload_fn(task)
                return task_append_event(task=task, event_type=event_type, payload=payload, actor=actor,
                                         side_effects=side_effects)
        except StaleWrite:
            continue
        except reducer.IllegalTransition as exc:
            refused_after_rollback(task_id=task_id, event_type=event_type, payload=payload, reason=exc.reason,
                                   actor=actor)
            raise
    raise StaleWrite(f"task {task_id}: {attempts} CAS attempts lost")
