"""The outbox claim's plan, and the batch's reads of task state, do not depend on the tables'
statistics (DESIGN.md §6; docs/performance.md, "The claim and the receipts without statistics").

A freshly filled outbox has no statistics until autovacuum analyses it: the planner then took the
claim's per-ticket ordering check (``NOT EXISTS`` an older open row of the same ordering key) as a
nested-loop anti-join that re-read every open row for each candidate, 155 ms a claim over a
1,000-row backlog. The check is now a scalar subquery, which PostgreSQL runs per candidate as an
probe per candidate (by the ordering-key index once the table is more than a few pages),
whatever it believes about the rows' statuses; and the JSON of the tasks' states is read in the
select list of the batch's queries, so only the batch's own tasks are parsed."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.utils import timezone

from apps.outbox import dispatch, receipts
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks.models import Task

pytestmark = pytest.mark.django_db


def _plan(sql: str, params) -> dict:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        return cursor.fetchone()[0][0]["Plan"]


def _nodes(plan: dict):
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def test_the_claims_ordering_check_is_an_index_probe_per_candidate():
    now = timezone.now()
    plan = _plan(dispatch._CLAIM_SQL.format(outbox=OutboxMessage._meta.db_table), {
        "pending": OutboxStatus.PENDING.value, "in_flight": OutboxStatus.IN_FLIGHT.value, "now": now,
        "open": [OutboxStatus.PENDING.value, OutboxStatus.IN_FLIGHT.value, OutboxStatus.UNKNOWN.value],
        "limit": 20, "owner": "plan", "until": now})
    nodes = list(_nodes(plan))
    assert not [n for n in nodes if n.get("Join Type") in ("Anti", "Semi")], json.dumps(plan)
    probes = [n for n in nodes if n.get("Parent Relationship") == "SubPlan"
              or n.get("Subplan Name", "").startswith("SubPlan")]
    assert probes, "the ordering check runs as a subplan per candidate"
    # (Inside it, the planner reads the open rows of one ordering key by the partial index once the
    # table is larger than a few pages; in this test's near-empty table a scan is as cheap.)
    assert [n for p in probes for n in _nodes(p) if n.get("Relation Name") == OutboxMessage._meta.db_table]


def test_the_batches_task_reads_filter_by_id_before_reading_any_state():
    for sql, params in ((dispatch._CANCEL_REQUESTED_SQL, [[]]), (receipts._TAKING_SQL, [[], ["DISPATCHING"]])):
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (VERBOSE, FORMAT JSON) " + sql.format(task=Task._meta.db_table), params)
            plan = cursor.fetchone()[0][0]["Plan"]
        for node in _nodes(plan):
            for key in ("Filter", "Index Cond", "Recheck Cond", "Join Filter", "Hash Cond"):
                assert "state" not in (node.get(key) or ""), f"{key} reads the state: {json.dumps(node)}"
