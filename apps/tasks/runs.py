"""A run's transaction (DESIGN.md §4, §5; spec §16.3 "先记录后使用"; docs/architecture.md §4): the
events a lease holder records between two activities commit together at its checkpoints, with the
task row written once per commit and the tenant's day row moved once, at the commit.

:class:`RunTransaction` is the transaction, :func:`checkpoint` commits it before an activity that leaves
the process, :func:`event_transaction` is where one event's writes go (the run's transaction itself,
without a savepoint, or a savepoint of a caller's transaction). The event writes themselves are
:mod:`apps.tasks.store`'s."""

from __future__ import annotations

import contextlib
import contextvars
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import structlog
from django.db import transaction

from apps.core import sql
from apps.events.models import TaskEvent
from apps.tasks.event_rows import events_insert_many
from apps.tasks.models import Task
from apps.tasks.usage import TenantLedgerBuffer

#: the same logger as the store's: one "event.appended" line per committed event
events_log = structlog.get_logger("faultdesk.events")


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
        #: the events appended under a held row and not inserted yet, in order (see :meth:`defer_event`)
        self._events: list = []
        self._flushing = False
        #: the tenant day-row moves of this transaction, written at its end (see :meth:`_flush`)
        self.ledger = TenantLedgerBuffer()
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
            self._events.clear()
            self.ledger.clear()
            self._lines.clear()
            self._wrapper.__exit__(None, None, None)
            _RUN.reset(self._token)
        return False

    def _open(self) -> None:
        self._held.clear()  # a new transaction holds no row yet
        self._events.clear()
        self.ledger.clear()
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
            self._events.clear()
            self.ledger.clear()

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

    def log_at_commit(self, line: dict) -> None:
        """Write the "event.appended" log line ``line`` once this transaction commits (one line
        per committed event); dropped if it rolls back."""
        self._lines.append(line)

    def release_hold(self, task_id) -> None:
        """Stop vouching for ``task_id``'s row (a write of it inside a nested transaction): its
        latest image is written first, so the row is in step with the events before it."""
        if task_id in self._held:
            self._write_rows()
            self._held.pop(task_id, None)

    def hold(self, task_id, *, version: int, generation: int | None, written: int | None = None,
             columns: dict | None = None, now=None) -> None:
        """This transaction locked the row of ``task_id`` (an event's CAS, or its lock alone), which
        stands at version ``written`` (default ``version``) with fencing token ``generation``; the
        events appended since put it at ``version``, with ``columns`` written at ``now`` by the next
        :meth:`_write_rows`."""
        if generation is not None:
            self._held[task_id] = _HeldRow(generation=generation, written=version if written is None else written,
                                           version=version, columns=columns, now=now)

    def hold_read(self, task: Task, *, generation: int) -> None:
        """This transaction locked ``task``'s row and read it whole as ``task`` (e.g. ``SELECT …
        FOR NO KEY UPDATE``), at fencing token ``generation``, which the row carries: the run's next
        event on it needs no lock statement, and ``task`` is current without a read
        (:meth:`current`). Raises ``ValueError`` when the row carries another token (the lease
        passed on: nothing may be written under ``generation``)."""
        if task.lease_generation != generation:
            raise ValueError(f"task {task.pk}: the row carries fencing token {task.lease_generation}, "
                             f"not {generation}")
        self.hold(task.pk, version=task.version, generation=generation)
        self._held[task.pk].task = task

    def defer_event(self, event) -> None:
        """Insert ``event`` (a :class:`~apps.events.models.TaskEvent` built in memory, of a row this
        transaction holds) with the others of this transaction in one statement, before any
        statement that reads the task or event tables and before the commit (:meth:`_write_rows`)."""
        self._events.append(event)

    def lease_change(self, task_id, generation: int, *, until=None, owner: str | None = None) -> bool:
        """Write a lease change of ``task_id`` with its row's next image instead of a statement of
        its own: a renewal to ``until`` for ``owner``, or (``until`` None) the release. Only while this
        transaction holds the row under ``generation`` (nobody else can have taken the lease) and at
        its own level (not inside a savepoint, which may roll back without it); returns False
        otherwise, and the caller writes it itself. Other sessions see a lease change
        at the commit either way."""
        row = self.held(task_id, generation)
        if row is None or len(transaction.get_connection().atomic_blocks) != self._depth:
            # inside a savepoint of the run the change must roll back with it: written at once
            return False
        row.lease = (owner, until)
        return True

    def _dirty(self) -> bool:
        return bool(self._events) or any(r.version > r.written or r.lease is not None for r in self._held.values())

    def _before_statement(self, execute, sql, params, many, context):
        """Django's execute wrapper: any statement that reads or writes the task table first sees
        the rows this transaction holds written as they stand (:meth:`_write_rows`) — and so does a
        ``SAVEPOINT``, so that a row image is never written inside a savepoint that may roll back
        (only events at the run's own level leave an image to write)."""
        if not self._flushing and (_TASK_TABLE in sql or _EVENT_TABLE in sql or sql.startswith("SAVEPOINT")) \
                and self._dirty():
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
                self.ledger.flush()
            except BaseException:
                transaction.set_rollback(True)
                raise

    def _write_rows(self) -> None:
        """Insert the deferred events (one statement), then write each held row's pending image —
        its version, state and derived columns, and a pending lease change — in one ``UPDATE``."""
        self._flushing = True
        try:
            if self._events:
                events, self._events = self._events, []
                try:
                    events_insert_many(events)
                except BaseException:
                    transaction.set_rollback(True)
                    raise
            for task_id, row in self._held.items():
                if row.version == row.written and row.lease is None:
                    continue
                params = {"task_id": task_id, "written": row.written, "generation": row.generation}
                sets = []
                if row.version != row.written:
                    c = row.columns
                    sets.append(_ROW_SET)
                    params.update(version=row.version, now=row.now, status=str(c["status"]),
                                  state=json.dumps(c["state"]), reason=c["termination_reason"],
                                  total=c["budget_total"], used=c["budget_used"], reserved=c["budget_reserved"])
                if row.lease is not None:
                    sets.append("lease_owner = %(owner)s, lease_expires_at = %(until)s")
                    params.update(owner=row.lease[0], until=row.lease[1])
                if sql.execute_bound(_ROW_SQL.format(task=_TASK_TABLE, sets=", ".join(sets)), params) != 1:
                    transaction.set_rollback(True)
                    raise RuntimeError(f"task {task_id}: its row left version {row.written} or fencing token "
                                       f"{row.generation} while locked")
                row.written, row.lease = row.version, None
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
    #: a lease change to write with the row: ``(owner, until)``, ``(None, None)`` for the release
    lease: tuple | None = None


_TASK_TABLE = Task._meta.db_table
_EVENT_TABLE = TaskEvent._meta.db_table
_ROW_SET = """version = %(version)s, updated_at = %(now)s, status = %(status)s, state = %(state)s::jsonb,
    termination_reason = %(reason)s, budget_total = %(total)s, budget_used = %(used)s, budget_reserved = %(reserved)s"""
_ROW_SQL = """
UPDATE {task} SET {sets}
WHERE id = %(task_id)s AND version = %(written)s AND lease_generation = %(generation)s
"""


def open_run() -> RunTransaction | None:
    """The run whose transaction is open in this context, or None (outside a run, or between a
    failed checkpoint's commit and the run's end)."""
    run = _RUN.get()
    return run if run is not None and run._atomic is not None else None


def run_current_task(task_id, lease_generation: int | None) -> Task | None:
    """The current run's in-memory task ``task_id`` when it is current without a read
    (:meth:`RunTransaction.current`), else None."""
    run = open_run()
    return run.current(task_id, lease_generation) if run is not None else None


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
