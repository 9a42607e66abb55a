"""Statements bound by the server and prepared once per connection (config/settings/base.py,
``DATABASE_PREPARE_THRESHOLD``; docs/performance.md, "Prepared statements").

A hot statement run ``DATABASE_PREPARE_THRESHOLD`` times on a connection is prepared there and
then only executed: PostgreSQL parses and plans it once. The values travel as parameters, never
quoted into the statement's text, so a JSON document with quotes, backslashes and NUL-free
Unicode reaches the column exactly; ``0`` turns preparing off for a pooler that cannot keep
prepared statements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from django.db import connection

from apps.core import sql
from apps.evidence.embedding import embed_query
from apps.evidence.relevance import evidence_select
from apps.evidence.selectors import evidence_rank, text_candidates, vector_literal
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from config.database import binding_options
from tests.conftest import p

ROOT = Path(__file__).resolve().parent.parent


def _prepared() -> set[str]:
    with connection.cursor() as cur:
        cur.execute("SELECT statement FROM pg_prepared_statements")
        return {r[0] for r in cur.fetchall()}


def _task(requester, device) -> Task:
    return task_submit(principal=p(requester), device_id=device.pk, urgency="low",
                       symptom="Paper jam in tray 2 after every restart.").task


def test_a_statement_run_past_the_threshold_is_prepared_on_its_connection(requester, device):
    task = _task(requester, device)
    threshold = connection.connection.prepare_threshold
    assert threshold == 5
    assert not [s for s in _prepared() if 'FROM "tasks_task" t0' in s and "t0.id = $1" in s]
    for _ in range(threshold + 1):
        found = sql.row(Task, "t0.id = %s", [task.pk])
        assert found.pk == task.pk and found.version == task.version
    prepared = [s for s in _prepared() if 'FROM "tasks_task" t0' in s and "t0.id = $1" in s]
    assert len(prepared) == 1, prepared  # one prepared statement, parameters as $n
    assert sql.row(Task, "t0.id = %s", [task.pk]).pk == task.pk  # and it still answers


def test_json_values_travel_as_parameters_and_arrive_exactly(db):
    awkward = {"q": 'a "quoted" \\ back\\slash \'single\' %s %(x)s $1', "zh": "打印机定影器错误 50.2",
               "n": [1, 2.5, None]}
    for _ in range(7):  # past the threshold: the prepared form answers the same
        with connection.cursor() as cur:  # Django's own cursor, as every ORM statement runs
            cur.execute("SELECT %s::jsonb, %s::text", [json.dumps(awkward), "100%"])
            document, text = cur.fetchone()  # Django's connections return jsonb as text
            assert (json.loads(document), text) == (awkward, "100%")


def test_the_threshold_is_read_from_the_environment_and_zero_turns_preparing_off():
    code = ("from django.conf import settings; o = settings.DATABASES['default']['OPTIONS']; "
            "print(o['server_side_binding'], o['prepare_threshold'])")
    for value, expected in (("", "True 5"), ("0", "True None"), ("2", "True 2")):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "DATABASE_PREPARE"))}
        env.update(DJANGO_SETTINGS_MODULE="config.settings.production", ENV_FILE="",
                   DATABASE_URL="postgres://u:p@db.invalid:5432/fd")
        if value:
            env["DATABASE_PREPARE_THRESHOLD"] = value
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: S603
                             timeout=120, check=True).stdout.strip().splitlines()[-1]
        assert out == expected, (value, out)


def test_the_retrieval_legs_are_planned_for_each_reader_never_prepared(db, kb, tenant, device):
    # Their best plans depend on how much the reader may see (every chunk, or one in a hundred).
    reading = {"kind": device.kind, "alert_code": device.alert_code, "alert_message": device.alert_message}
    for scopes in (["public", "tier2", "security"], ["public"]) * 4:  # past the threshold, both readers
        with connection.cursor() as cur:
            text_candidates(cur, tenant_id=tenant.pk, scopes=scopes, query="fuser error smeared pages", limit=10)
        evidence_select(tenant_id=tenant.pk, scopes=scopes, report="fuser error, smeared pages", device=reading, k=5)
        evidence_rank(tenant_id=tenant.pk, scopes=scopes, query="fuser error", k=5,
                      qvec=vector_literal(embed_query("fuser error")))
    legs = [s for s in _prepared() if "search_vector" in s or "<=>" in s]
    assert not legs, legs
    with connection.cursor() as cur:  # and they still answer
        assert text_candidates(cur, tenant_id=tenant.pk, scopes=["public", "tier2"], query="fuser", limit=10)
    assert evidence_select(tenant_id=tenant.pk, scopes=["public", "tier2"], report="fuser error, smeared pages",
                           device=reading, k=5).refs


def test_zero_turns_preparing_off_from_the_url_too():
    url_zero = binding_options({"OPTIONS": {"prepare_threshold": 0}}, prepare_threshold=5)["OPTIONS"]
    assert url_zero == {"server_side_binding": True, "prepare_threshold": None}  # psycopg: None is never
    assert binding_options({}, prepare_threshold=0)["OPTIONS"]["prepare_threshold"] is None
    from_url = binding_options({"OPTIONS": {"prepare_threshold": "3"}}, prepare_threshold=5)["OPTIONS"]
    assert from_url["prepare_threshold"] == 3
