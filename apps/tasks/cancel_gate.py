"""The cancel gate (DESIGN.md §8, §12.3 "after a cancel, no new action starts"; spec §16.4 TOCTOU):
what lets a request's last re-authorization wait for a cancel already on its way.

A cancel records ``cancel.requested`` under the task row's lock. A run that commits an intent holds
that lock until its commit, so a cancel issued meanwhile waits for it and commits right after — in
the moment between the intent's commit and the request, when a plain read of the task does not see
it yet, and a row lock taken on the task does not reliably queue behind it either (the cancel waits
on the old row version; the commit made a new one). So a cancel first takes this gate, shared, in
its own transaction before it waits for the row (:func:`cancel_gate_enter`), and every
re-authorization before a request — direct delivery's and the dispatcher's — takes it exclusively
first (:func:`cancels_in_flight_wait`): that waits until each such cancel has committed or rolled
back, and the read after it sees the outcome; past the lock timeout nothing is sent. A cancel that
begins after that is the window every re-authorization has before its request; it is handled as a
cancel during the request (its ticket recorded, its compensation asked for). PostgreSQL advisory
locks: in memory, no write, released at the end of their transaction."""

from __future__ import annotations

import uuid

from django.db import connection

#: the advisory-lock namespace of the gate (the first of the two int4 keys), "fd" + "cg"
_NAMESPACE = 0x66646367


def _key(task_id) -> int:
    """The task's second int4 key (31 bits of its id: two tasks sharing one only wait for each
    other's cancels, never miss one)."""
    return uuid.UUID(str(task_id)).int & 0x7FFFFFFF


def cancel_gate_enter(task_id) -> None:
    """Take the gate of ``task_id`` shared, in the caller's transaction (a cancel's, before it locks
    the task row); held until that transaction ends. Raises what the database raises."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock_shared(%s, %s)", [_NAMESPACE, _key(task_id)])


def cancels_in_flight_wait(*task_ids) -> None:
    """Wait until every cancel of the tasks ``task_ids`` that has entered the gate has ended
    (committed or rolled back); one statement outside any transaction, so the gates are held for
    that statement only, taken in key order (two waiters never hold each other up in a cycle). A
    read of the tasks after it sees those cancels. Raises ``OperationalError`` past the session's
    ``lock_timeout`` — the caller must then not send (fail closed)."""
    keys = sorted({_key(task_id) for task_id in task_ids})
    if not keys:
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_advisory_xact_lock(%s, k)) FROM (SELECT k FROM unnest(%s::int[]) AS k "
                       "ORDER BY k) AS ordered", [_NAMESPACE, keys])
