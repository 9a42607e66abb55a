"""Recording each outbound call (ADR 0022): one ``INSERT`` of a :class:`~apps.gateway.models.GatewayCall`
on a database connection of the gateway's own, in autocommit — outside whatever transaction the
caller holds, so a caller that rolls back (a run's transaction, a refused event) still leaves the
record of what it sent.

The connection is one per process (made again after a fork), shared by the process's threads under a
lock: the outbox's sender threads record one at a time, each insert a quarter of a millisecond or so
(``apps/gateway/tests/test_records.py`` measures it). Its commits do not wait for the WAL to reach the
disk (``synchronous_commit=off``, a startup option of that connection only): a record is operational, and waiting for a
flush at every outbound call cost ~4 ms each. A record that cannot be written (the database is down, a
test without database access) is logged and dropped, and none is tried for ``PAUSE_SECONDS``: the call's
own outcome never depends on its record.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from datetime import datetime

import structlog
from django.db import DEFAULT_DB_ALIAS, connections

from apps.gateway.destinations import Destination
from apps.gateway.models import GatewayCall

log = logging.getLogger(__name__)

_TABLE = GatewayCall._meta.db_table
_COLUMNS = ("at", "tool", "scheme", "host", "port", "method", "path", "outcome", "http_status", "bytes_received",
            "duration_ms", "tenant_id", "task_id")
_INSERT = (f"INSERT INTO {_TABLE} ({', '.join(_COLUMNS)}) "  # noqa: S608 - the model's own table and columns
           f"VALUES ({', '.join(['%s'] * len(_COLUMNS))})")

_lock = threading.Lock()
_own: tuple[int, object] | None = None
#: after a record fails, none is tried before this ``time.monotonic()`` (a database that is down is
#: not reconnected to at every call: each try would cost the call a connection attempt)
_pause_until = 0.0
#: seconds without records after a failure
PAUSE_SECONDS = 5.0


def _connection():
    """The process's own connection wrapper (not the thread's: that one may be inside a transaction).
    Its commits do not wait for the WAL's flush: ``synchronous_commit=off`` is a startup option of this
    connection alone (never a ``SET`` on a connection another request or task reuses)."""
    global _own
    pid = os.getpid()
    default = connections[DEFAULT_DB_ALIAS]
    if _own is not None and (_own[0] != pid or _own[1].settings_dict.get("NAME") != default.settings_dict.get("NAME")):
        if _own[0] == pid:
            _own[1].close()
        _own = None  # a parent's connection (before a fork) is the parent's: never used or closed here
    if _own is None:
        db = default.settings_dict
        options = dict(db.get("OPTIONS") or {})
        options["options"] = f"{options.get('options', '')} -c synchronous_commit=off".strip()
        wrapper = type(default)({**db, "OPTIONS": options}, DEFAULT_DB_ALIAS)
        wrapper.inc_thread_sharing()  # used from every thread of the process, one at a time (the lock)
        _own = (pid, wrapper)
    wrapper = _own[1]
    if wrapper.connection is None:
        wrapper.ensure_connection()
    return wrapper


def _bound_ids() -> tuple[int | None, uuid.UUID | None]:
    """``(tenant_id, task_id)`` from the ids bound to this context's log lines (``config.logs.bind``),
    each None when absent or unreadable."""
    bound = structlog.contextvars.get_contextvars()
    tenant, task = bound.get("tenant_id"), bound.get("task_id")
    try:
        tenant = int(tenant) if tenant is not None else None
    except (TypeError, ValueError):
        tenant = None
    try:
        task = uuid.UUID(str(task)) if task is not None else None
    except ValueError:
        task = None
    return tenant, task


def call_record(*, tool: str, destination: Destination, method: str, path: str, outcome: str, at: datetime,
                duration_ms: int, http_status: int | None = None, bytes_received: int = 0) -> None:
    """Record one call (see the module). ``path`` is cut at its query string and at 500 characters;
    ``at`` is when the call started; the tenant and task are the ones bound to the caller's context.
    Raises nothing."""
    global _pause_until
    tenant_id, task_id = _bound_ids()
    path = path.split("?", 1)[0][:500]
    row = (at, tool, destination.scheme, destination.host[:255], destination.port, method[:10], path, outcome,
           http_status, int(bytes_received), max(0, int(duration_ms)), tenant_id, task_id)
    if time.monotonic() < _pause_until:
        log.debug("outbound call not recorded (recording paused after a failure): %s %s → %s", tool, method, outcome)
        return
    try:
        with _lock:
            wrapper = _connection()
            try:
                wrapper.connection.execute(_INSERT, row)  # psycopg's own: one statement, autocommit
            except Exception:
                wrapper.close()  # a broken connection is made again at the next record
                raise
    except Exception as exc:  # noqa: BLE001 - a record must never change the call's outcome
        _pause_until = time.monotonic() + PAUSE_SECONDS
        log.warning("outbound call not recorded (%s %s %s → %s): %s", tool, method, destination, outcome,
                    type(exc).__name__)


def close() -> None:
    """Close the recorder's connection (a test session before its database is dropped; a process
    about to exit)."""
    global _own
    with _lock:
        if _own is not None and _own[0] == os.getpid():
            _own[1].close()
        _own = None
