"""Event and snapshot rows written many to a statement (DESIGN.md §4): a run's commit
(:class:`~apps.tasks.runs.RunTransaction`) and the batched append (:mod:`apps.tasks.batch`) insert
their events with one ``INSERT … VALUES``, their parameters bound by the server (the payloads are
JSON of up to tens of kilobytes: :func:`~apps.core.sql.execute_bound`)."""

from __future__ import annotations

import json

from django.db import connection

from apps.core.sql import execute_bound
from apps.events.models import TaskEvent, TaskSnapshot

_INSERT_MANY_SQL = """
INSERT INTO {event} (id, task_id, tenant_id, seq, type, payload, payload_digest, occurred_at, recorded_at,
                     causation_id, actor, lease_generation)
VALUES {rows}
"""
_INSERT_ROW = "(%s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s)"


def events_insert_many(events: list[TaskEvent]) -> None:
    """Write ``events`` (built in memory with their ids, seqs, digests and times set) in one
    ``INSERT … VALUES`` statement, as they are, and mark them saved. The batched append
    (:mod:`apps.tasks.batch`) uses it instead of ``bulk_create``, whose ``UNNEST`` form makes
    psycopg escape every JSON payload as an array element in Python (a regular-expression
    substitution per quote character) — most of a batch's insert cost. Raises
    ``IntegrityError`` when a ``(task, seq)`` is taken."""
    if not events:
        return
    params: list = []
    for e in events:
        params += [e.id, e.task_id, e.tenant_id, e.seq, e.type, json.dumps(e.payload), e.payload_digest,
                   e.occurred_at, e.recorded_at, e.causation_id, e.actor, e.lease_generation]
    execute_bound(_INSERT_MANY_SQL.format(event=TaskEvent._meta.db_table,
                                          rows=", ".join([_INSERT_ROW] * len(events))), params)
    for e in events:
        e._state.adding, e._state.db = False, connection.alias


_SNAPSHOTS_SQL = """
INSERT INTO {snapshot} (task_id, seq, state, digest, reducer_version, created_at) VALUES {rows}
"""


def snapshots_insert_many(snapshots: list[TaskSnapshot], *, now) -> None:
    """Write ``snapshots`` (task, seq, state, digest and reducer version set) in one ``INSERT …
    VALUES`` statement with ``created_at = now`` (see :func:`events_insert_many` for why not
    ``bulk_create``). Raises ``IntegrityError`` when a ``(task, seq)`` is taken."""
    if not snapshots:
        return
    params: list = []
    for s in snapshots:
        params += [s.task_id, s.seq, json.dumps(s.state), s.digest, s.reducer_version, now]
    rows = ", ".join(["(%s, %s, %s::jsonb, %s, %s, %s)"] * len(snapshots))
    with connection.cursor() as cursor:
        cursor.execute(_SNAPSHOTS_SQL.format(snapshot=TaskSnapshot._meta.db_table, rows=rows), params)
