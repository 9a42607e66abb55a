"""The task aggregate's commit path (DESIGN.md §4, §5; spec §16.3 "并发恢复版本约束").

Commit = ``UPDATE task SET … , version = v + 1 WHERE id = ? AND version = v [AND lease_generation
= g]`` plus the event insert, in one transaction. Zero rows updated means the writer lost: it
re-reads, it never overwrites. An event δ refuses, or a write that lost, is recorded as a
:class:`~apps.events.models.RefusedEvent`, never applied.

Other apps keep their rows in step with the task through *projections*: a function registered with
:func:`projection_register` (from the app's ``AppConfig.ready``) runs inside every event's
transaction, so the task never needs to know their models (the approvals app closes its pending
requests when a task is cancelled or ends).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import structlog
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.core.digests import sha256_json
from apps.core.failpoints import failpoint
from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.usage import TenantLedgerBuffer, tenant_ledger_apply, tenant_ledger_apply_many, tenant_ledger_moves

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


class StaleWrite(Exception):
    """The CAS lost: the task moved past ``expected_version`` or the lease passed to another
    worker (fencing token ``lease_generation`` no longer current)."""


# --- a run's events, committed at its checkpoints ----------------------------------------------------

class RunTransaction:
    """The events a run records between two activities, committed together (DESIGN.md §4, §5; spec
    §16.3 "先记录后使用").

    A run (one lease holder driving a task through its steps, its lease claimed and committed
    before) opens one transaction with ``with RunTransaction():``. Every write inside it — each
    event, the lease release — commits at the next :func:`checkpoint` or when the block ends,
    instead of one commit each. An activity that leaves the process or takes time (the context
    reads, a model call, a ticket system read, a backoff) runs inside ``with checkpoint():``,
    outside any transaction, after what the run recorded so far is committed: what it consumes is
    durable before it starts, and its result is recorded before anything uses it, in the
    transaction that follows.

    What one commit holds, one crash loses whole: the events since the last checkpoint are all
    there or none is, and a crash before the commit leaves the task where the last checkpoint left
    it, as a crash before any of those events did. Inside the transaction:

    * an event takes no savepoint (:func:`event_transaction`): it raises the refusals its caller
      expects — δ's, a lost CAS, the tenant's quota — before it writes, and a failure after it
      wrote marks the transaction for rollback;
    * from its first CAS the transaction holds the task row locked, so another writer waits (a
      cancel) or skips it (a claim), and the next events of the same commit need no CAS
      statement: they are inserted alone, and the row's new image is written once — before any
      statement that touches the task table or opens a savepoint, and before the commit
      (:meth:`_write_rows`);
    * the tenant's day row moves once, by the sum of the commit's ledger events, at the commit
      (:class:`~apps.tasks.usage.TenantLedgerBuffer`).

    The block commits when it ends, also when an exception leaves it — what was recorded stands,
    as with one commit per event — unless the transaction can no longer commit (a statement failed
    outside a savepoint, or an event failed after it wrote), which rolls it back. A commit that
    fails (the session ended) leaves nothing held: no row image of it is ever written later. Not
    re-entrant: a run inside a run raises ``RuntimeError``."""

    def __init__(self) -> None:
        self._atomic = None
        self._depth = 0
        self._token = None
        self._wrapper = None
        #: task id -> the row this transaction holds locked: see :class:`_HeldRow`
        self._held: dict[uuid.UUID, _HeldRow] = {}
        self._flushing = False
        #: the tenant day-row moves of this transaction, written at its end
        self._ledger = TenantLedgerBuffer()
        #: the "event.appended" log lines of this transaction's events, written once it commits
        self._lines: list[dict] = []

    def __enter__(self) -> RunTransaction:
        if _RUN.get() is not None:
            raise RuntimeError("a run transaction is already open in this context")
        self._open()
        self._token = _RUN.set(self)
        self._wrapper = transaction.get_connection().execute_wrapper(self._before_statement)
        self._wrapper.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._atomic is not None:
                atomic, self._atomic = self._atomic, None
                if exc_type is None or _usable():
                    # What the run recorded before an exception stands, as it would have with one
                    # commit per event (an event that failed after writing doomed the transaction).
                    self._flush_and_commit(atomic)
                else:
                    atomic.__exit__(exc_type, exc, tb)
        finally:
            self._held.clear()
            self._ledger.clear()
            self._lines.clear()
            self._wrapper.__exit__(None, None, None)
            _RUN.reset(self._token)
        return False

    def _open(self) -> None:
        self._held.clear()  # a new transaction holds no row yet
        self._ledger.clear()
        self._lines.clear()
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self._depth = len(transaction.get_connection().atomic_blocks)

    def _commit(self) -> None:
        if len(transaction.get_connection().atomic_blocks) != self._depth:
            raise transaction.TransactionManagementError(
                "checkpoint() inside a nested transaction: an activity must run at the run's own level")
        atomic, self._atomic = self._atomic, None
        try:
            self._flush_and_commit(atomic)
        finally:
            # Committed or rolled back, this transaction is over and holds nothing any more: a
            # row image it could not commit must never be written later, by anyone.
            self._held.clear()
            self._ledger.clear()

    def _flush_and_commit(self, atomic) -> None:
        """Write what is pending (:meth:`_flush`) and commit ``atomic``; when the writing fails,
        roll it back and raise."""
        lines, self._lines = self._lines, []
        try:
            self._flush()
        except BaseException as exc:
            atomic.__exit__(type(exc), exc, exc.__traceback__)
            raise
        atomic.__exit__(None, None, None)
        for line in lines:  # one line per committed event: these events are committed now
            events_log.info("event.appended", **line)

    # -- the task rows this transaction holds ------------------------------------------------------

    def held(self, task_id, lease_generation: int | None) -> _HeldRow | None:
        """The row of ``task_id`` this transaction holds locked at fencing token
        ``lease_generation`` (not None), or None."""
        row = self._held.get(task_id)
        return row if row is not None and lease_generation is not None and row.generation == lease_generation \
            else None

    def current(self, task_id, lease_generation: int | None) -> Task | None:
        """The task object last appended to under ``lease_generation`` in this transaction, while the
        transaction holds its row (so nobody else can have moved it): current without a read."""
        row = self.held(task_id, lease_generation)
        task = row.task if row is not None else None
        return task if task is not None and task.version == row.version else None

    def hold(self, task_id, *, version: int, generation: int | None) -> None:
        """This transaction locked the row of ``task_id`` (a claim, an event's CAS), which stands at
        ``version`` with fencing token ``generation``."""
        if generation is not None:
            self._held[task_id] = _HeldRow(generation=generation, written=version, version=version)

    def _before_statement(self, execute, sql, params, many, context):
        """Django's execute wrapper: any statement that reads or writes the task table first sees
        the rows this transaction holds written as they stand (:meth:`_write_rows`) — and so does a
        ``SAVEPOINT``, so that a row image is never written inside a savepoint that may roll back
        (only events at the run's own level leave an image to write)."""
        if not self._flushing and (_TASK_TABLE in sql or sql.startswith("SAVEPOINT")) \
                and any(r.version > r.written for r in self._held.values()):
            self._write_rows()
        return execute(sql, params, many, context)

    def _flush(self, *, ledger: bool = True) -> None:
        """Write each held row's latest image (version, state and the columns derived from it)
        where events were appended since it was last written, then (``ledger``) the tenant's day
        rows by the sums of this transaction's moves. The row is locked by this transaction, so
        its version is still the one last written; anything else is a defect and raises
        ``RuntimeError``; a day row past the quota raises
        :class:`~apps.tasks.usage.TenantQuotaRace`. Either marks the transaction for rollback."""
        self._write_rows()
        if ledger:
            try:
                self._ledger.flush()
            except BaseException:
                transaction.set_rollback(True)
                raise

    def _write_rows(self) -> None:
        self._flushing = True
        try:
            for task_id, row in self._held.items():
                if row.version == row.written:
                    continue
                c = row.columns
                with connection.cursor() as cursor:
                    cursor.execute(_ROW_SQL.format(task=_TASK_TABLE), {
                        "task_id": task_id, "written": row.written, "version": row.version, "now": row.now,
                        "generation": row.generation,
                        "status": str(c["status"]), "state": json.dumps(c["state"]), "reason": c["termination_reason"],
                        "total": c["budget_total"], "used": c["budget_used"], "reserved": c["budget_reserved"]})
                    if cursor.rowcount != 1:
                        transaction.set_rollback(True)
                        raise RuntimeError(f"task {task_id}: its row left version {row.written} or fencing token "
                                           f"{row.generation} while locked")
                row.written = row.version
        finally:
            self._flushing = False


@dataclass
class _HeldRow:
    """A task row a run's transaction holds locked: the fencing token it was locked under, the
    version last written to it, and the version, columns and time of the events appended since
    (written by :meth:`RunTransaction._flush`)."""

    generation: int
    written: int
    version: int
    columns: dict | None = None
    now: object = None
    #: the in-memory task the last event was appended to (it follows the row)
    task: Task | None = None


_TASK_TABLE = Task._meta.db_table
_ROW_SQL = """
UPDATE {task} SET version = %(version)s, updated_at = %(now)s, status = %(status)s, state = %(state)s::jsonb,
    termination_reason = %(reason)s, budget_total = %(total)s, budget_used = %(used)s, budget_reserved = %(reserved)s
WHERE id = %(task_id)s AND version = %(written)s AND lease_generation = %(generation)s
"""


def run_holds(task_id, lease_generation: int | None) -> bool:
    """Does the current run's transaction hold ``task_id``'s row locked under ``lease_generation``?"""
    run = _RUN.get()
    return run is not None and run._atomic is not None and run.held(task_id, lease_generation) is not None


def run_current_task(task_id, lease_generation: int | None) -> Task | None:
    """The current run's in-memory task ``task_id`` when it is current without a read
    (:meth:`RunTransaction.current`), else None."""
    run = _RUN.get()
    return run.current(task_id, lease_generation) if run is not None and run._atomic is not None else None


def _usable() -> bool:
    """Can the open transaction still commit (no failed statement outside a savepoint)?"""
    from psycopg.pq import TransactionStatus

    conn = transaction.get_connection()
    if conn.needs_rollback or conn.connection is None:
        return False
    return conn.connection.info.transaction_status in (TransactionStatus.IDLE, TransactionStatus.INTRANS)


_RUN: contextvars.ContextVar[RunTransaction | None] = contextvars.ContextVar("faultdesk_run_transaction",
                                                                            default=None)


@contextlib.contextmanager
def checkpoint() -> Iterator[None]:
    """Commit what the current run recorded so far, run the block outside any transaction, and open
    the run's next transaction after it (see :class:`RunTransaction`). Outside a run, every event
    was already committed by itself and the block simply runs. Raises
    ``TransactionManagementError`` when called inside a nested ``atomic`` block of the run (an
    activity must not run while a savepoint of the run is open)."""
    run = _RUN.get()
    if run is None or run._atomic is None:
        yield
        return
    run._commit()
    try:
        yield
    finally:
        run._open()


def worker_identity() -> str:
    """``host:pid`` of this process — the lease owner string."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _state_digest(state: dict) -> str:
    return sha256_json(state)


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, marked with "…" when cut (the full text stays in
    the event)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _apply_row(task: Task, new_state: dict) -> dict:
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


def _reduce_pinned(task: Task, event_type: str, payload: dict, *, state: dict | None = None) -> dict:
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
        new_state = _reduce_pinned(task, event_type, payload)
    except reducer.IllegalTransition as exc:
        refused_event_record(task=task, event_type=event_type, payload=payload, reason=exc.reason, actor=actor,
                             lease_generation=lease_generation)
        raise
    expected = task.version
    now = timezone.now()
    failpoint(f"before_commit:{event_type}")
    columns = _apply_row(task, new_state)
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
    run = _RUN.get()
    held = run.held(task.pk, lease_generation) if run is not None and run._atomic is not None else None
    if held is not None:
        held.task = task
        run._lines.append(line)  # logged when the run's transaction commits
    else:
        events_log.info("event.appended", **line)
    # The in-memory task follows the row (and, in a run, the run's transaction).
    for name, value in columns.items():
        setattr(task, name, value)
    task.version = expected + 1
    # "After commit" means after the outermost commit: inside a caller's transaction (a receipt
    # recorded with its action and outbox rows) the failpoint waits for that commit.
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: failpoint(f"after_commit:{event_type}"))
    else:
        failpoint(f"after_commit:{event_type}")
    return task


@contextlib.contextmanager
def event_transaction() -> Iterator[bool]:
    """The transaction an event's writes go in: inside a run's own transaction (its level, no
    savepoint of it open) the run's transaction itself, yielding True; anywhere else a
    ``transaction.atomic()`` block (a savepoint inside a caller's transaction), yielding False.

    Without a savepoint, an event raises the refusals its callers expect — δ's, a lost CAS, the
    tenant's quota — before it writes anything, so the run's transaction goes on after them; a
    failure after the event wrote (its side effects, a projection) marks the run's transaction for
    rollback, which its end then rolls back whole, as a crash before the commit would."""
    run = _RUN.get()
    if run is not None and run._atomic is not None and len(transaction.get_connection().atomic_blocks) == run._depth:
        yield True
        return
    with transaction.atomic():
        yield False


_LOCK_SQL = "SELECT 1 FROM {task} WHERE id = %(task_id)s AND version = %(expected)s {fence} FOR UPDATE"


def _write_event(task: Task, new_state: dict, columns: dict, *, lean: bool, expected: int,
                 lease_generation: int | None, now, event_type: str, payload: dict, actor: str, causation_id,
                 occurred_at, side_effects) -> TaskEvent:
    """The writes of one event (:func:`task_append_event`), in the order that lets an event with no
    savepoint (``lean``) refuse before it writes: an event that moves the tenant's day ledger first
    locks its task row at the expected version and fencing token (:class:`StaleWrite` otherwise)
    and moves the day row under the quota (:class:`~apps.tasks.usage.BudgetExceeded`: the row is
    not moved); then the CAS and the event's insert (:class:`StaleWrite` when it matched nothing);
    then the snapshot, the side effects and the projections, whose failure, when ``lean``, marks
    the transaction for rollback.

    When ``lean`` and the run's transaction already holds the task row locked under this fencing
    token (its claim, or an earlier event of the same commit), the CAS is settled without a
    statement — nobody else can have moved the row — and the row's new image is left to the run,
    which writes it once before anything reads the task table and before it commits
    (:class:`RunTransaction`): the events are inserted one by one, the row written once. Returns
    the event."""
    run = _RUN.get()
    if run is not None and not lean and run._atomic is not None and task.pk in run._held:
        # A write inside a nested transaction of the run: the row is brought up to date and the run
        # stops vouching for it (the nested transaction may still roll this event back).
        run._write_rows()
        run._held.pop(task.pk, None)
    run = run if lean else None
    held = run.held(task.pk, lease_generation) if run is not None else None
    if held is not None and held.version != expected:
        raise StaleWrite(f"task {task.pk}: expected version {expected}, the run holds it at {held.version}")
    fence = "AND lease_generation = %(fence)s" if lease_generation is not None else ""
    moves = "limits" in new_state and tenant_ledger_moves(task.state, new_state)
    if moves and run is not None:
        run._ledger.admit(task, task.state, new_state)  # BudgetExceeded: nothing written
    elif moves:
        if held is None:
            with connection.cursor() as cursor:
                cursor.execute(_LOCK_SQL.format(task=Task._meta.db_table, fence=fence),
                               {"task_id": task.pk, "expected": expected, "fence": lease_generation})
                if cursor.fetchone() is None:
                    raise StaleWrite(f"task {task.pk}: expected version {expected}, generation {lease_generation}")
        tenant_ledger_apply(task, task.state, new_state)  # BudgetExceeded: nothing written
    if held is not None:
        event = _event_insert(task, expected=expected, lease_generation=lease_generation, now=now,
                              event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                              occurred_at=occurred_at)
        held.version, held.columns, held.now = expected + 1, columns, now
    else:
        event = _cas_and_insert(task, columns, expected=expected, lease_generation=lease_generation, now=now,
                                event_type=event_type, payload=payload, actor=actor, causation_id=causation_id,
                                occurred_at=occurred_at)
        if run is not None:
            run.hold(task.pk, version=expected + 1, generation=lease_generation)
    if moves and run is not None:
        run._ledger.add(task, task.state, new_state)  # the day row moves once, at the commit
    try:
        every = settings.FAULTDESK["SNAPSHOT_EVERY"]
        if every and (expected + 1) % every == 0:
            TaskSnapshot.objects.create(
                task_id=task.pk, seq=expected + 1, state=new_state, digest=_state_digest(new_state),
                reducer_version=(task.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION),
            )
        if side_effects is not None:
            side_effects(task, event)
        for project in _PROJECTIONS:
            project(task, event, new_state)
    except BaseException:
        if lean:
            transaction.set_rollback(True)  # the event is written: only the whole transaction can undo it
        raise
    return event


_INSERT_SQL = """
INSERT INTO {event} (id, task_id, tenant_id, seq, type, payload, payload_digest, occurred_at, recorded_at,
                     causation_id, actor, lease_generation)
VALUES (%(event_id)s, %(task_id)s, %(tenant_id)s, %(seq)s, %(type)s, %(payload)s::jsonb, %(digest)s, %(occurred_at)s,
        %(now)s, %(causation_id)s, %(actor)s, %(event_generation)s)
"""


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


def _event_insert(task: Task, **kwargs) -> TaskEvent:
    """The event's ``INSERT`` alone (the run holds the task row; see :func:`_write_event`)."""
    event, params = _new_event(task, **kwargs)
    with connection.cursor() as cursor:
        cursor.execute(_INSERT_SQL.format(event=TaskEvent._meta.db_table), params)
    event._state.adding, event._state.db = False, connection.alias
    return event


_APPEND_SQL = """
WITH cas AS (
    UPDATE {task} SET version = %(seq)s, updated_at = %(now)s, status = %(status)s, state = %(state)s::jsonb,
        termination_reason = %(reason)s, budget_total = %(total)s, budget_used = %(used)s,
        budget_reserved = %(reserved)s
    WHERE id = %(task_id)s AND version = %(expected)s {fence}
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
    sql = _APPEND_SQL.format(task=Task._meta.db_table, event=TaskEvent._meta.db_table,
                             fence="AND lease_generation = %(fence)s" if lease_generation is not None else "")
    with connection.cursor() as cursor:
        cursor.execute(sql, {
            **params, "expected": expected, "fence": lease_generation, "seq": expected + 1,
            "status": str(columns["status"]), "state": json.dumps(columns["state"]),
            "reason": columns["termination_reason"], "total": columns["budget_total"],
            "used": columns["budget_used"], "reserved": columns["budget_reserved"],
        })
        if cursor.rowcount != 1:
            raise StaleWrite(f"task {task.pk}: expected version {expected}, generation {lease_generation}")
    event._state.adding, event._state.db = False, connection.alias
    return event


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
    memory. ``then``, when given, is asked after each event for one more event of that task,
    appended right after it in the same commit (δ applied to it too; one that δ refuses is left
    out, and the first event stands without it). Writes nothing. Returns ``(prepared, refused)``:
    ``refused`` lists ``(task_id, event_type, payload, reason)`` for the events δ refuses (and
    ``payload`` None, reason "no such task", for a task that does not exist); the caller leaves
    them out of the batch and records them (:func:`task_append_with_retry` does). Raises
    ``ValueError`` when a task is named twice, ``TransactionManagementError`` outside a
    transaction."""
    if not transaction.get_connection().in_atomic_block:
        raise transaction.TransactionManagementError("task_events_prepare needs the caller's transaction")
    ids = [r[0] for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("one event per task in a batch")
    locked = Task.objects.select_for_update(of=("self",)).select_related("tenant")  # the tenant is read, not locked
    tasks = {t.pk: t for t in locked.filter(pk__in=ids).order_by("pk")}
    prepared, refused = [], []
    for task_id, event_type, payload_fn, actor in requests:
        task = tasks.get(task_id)
        if task is None:
            refused.append((task_id, event_type, None, "no such task"))
            continue
        payload = payload_fn(task)
        try:
            new_state = _reduce_pinned(task, event_type, payload)
        except reducer.IllegalTransition as exc:
            refused.append((task_id, event_type, payload, exc.reason))
            continue
        item = PreparedEvent(task=task, event_type=event_type, payload=payload, actor=actor, new_state=new_state)
        following = then(task, new_state) if then is not None else None
        if following is not None:
            follow_type, follow_payload = following
            try:
                after = _reduce_pinned(task, follow_type, follow_payload, state=new_state)
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
    columns = [(p, _apply_row(p.task, p.new_state)) for p in prepared]
    params: list = [now]
    for (p, c), (_, chain) in zip(columns, chains, strict=True):
        params += [str(p.task.pk), p.task.version, len(chain), c["status"], json.dumps(c["state"]),
                   c["termination_reason"], c["budget_total"], c["budget_used"], c["budget_reserved"]]
    sql = _CAS_MANY_SQL.format(table=Task._meta.db_table, rows=", ".join([_CAS_ROW] * len(prepared)))
    if not transaction.get_connection().in_atomic_block:
        raise transaction.TransactionManagementError("task_events_commit needs the caller's transaction")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        if cursor.rowcount != len(prepared):
            raise StaleWrite(f"{len(prepared) - cursor.rowcount} of {len(prepared)} tasks moved past their version")
    rows = [TaskEvent(task_id=p.task.pk, tenant_id=p.task.tenant_id, seq=p.task.version + 1 + i, type=event_type,
                      payload=payload, payload_digest=sha256_json(payload), occurred_at=now, actor=p.actor,
                      lease_generation=p.task.lease_generation)
            for p, chain in chains for i, (event_type, payload, _) in enumerate(chain)]
    events = TaskEvent.objects.bulk_create(rows)
    every = settings.FAULTDESK["SNAPSHOT_EVERY"]
    snapshots = [TaskSnapshot(task_id=p.task.pk, seq=p.task.version + 1 + i, state=state, digest=_state_digest(state),
                              reducer_version=(p.task.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION))
                 for p, chain in chains for i, (_, _, state) in enumerate(chain)
                 if every and (p.task.version + 1 + i) % every == 0]
    if snapshots:
        TaskSnapshot.objects.bulk_create(snapshots)
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
            for project in _PROJECTIONS:
                project(before, event, state)
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
