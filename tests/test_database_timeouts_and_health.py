"""Database session timeouts and readiness (config/database.py, apps/traces/health.py).

A session left idle inside a transaction while holding a task row is ended by PostgreSQL, so the
dispatcher that must lock that row to record a receipt goes on instead of waiting; a lock wait
past ``lock_timeout`` is refused, and the refusal is retried (the outbox row is re-claimed, the
Celery step retried) without a second ticket. ``/healthz`` answers 503 naming what is wrong —
an old open transaction, a lagging outbox, a broker that does not answer — and ``/metrics`` carries
the same figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from apps.actions.models import Action, ActionStatus
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks.models import Task
from config.database import retryable, timeout_options
from tests.conftest import settle_receipts

ROOT = Path(__file__).resolve().parent.parent


def _other_session(*, idle_in_transaction_ms: int = 0) -> psycopg.Connection:
    """A second, independent session of the test database with our timeout options."""
    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    opts = timeout_options({"OPTIONS": {}}, statement_ms=30_000, lock_ms=10_000,
                           idle_in_transaction_ms=idle_in_transaction_ms)["OPTIONS"]["options"]
    return psycopg.connect(**params, options=opts, autocommit=False)


def test_every_setting_opens_connections_with_the_three_timeouts(db):
    with connection.cursor() as cur:
        cur.execute("SHOW statement_timeout")
        assert cur.fetchone()[0] == "30s"
        cur.execute("SHOW lock_timeout")
        assert cur.fetchone()[0] == "10s"
    code = "from django.conf import settings; print(settings.DATABASES['default']['OPTIONS']['options'])"
    for module in ("config.settings.local", "config.settings.production"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
        env.update(DJANGO_SETTINGS_MODULE=module, ENV_FILE="", DATABASE_URL="postgres://u:p@db.invalid:5432/fd")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: S603
                             timeout=120, check=True).stdout.strip().splitlines()[-1]
        assert out == ("-c statement_timeout=30000 -c lock_timeout=10000 "
                       "-c idle_in_transaction_session_timeout=60000"), (module, out)


def test_retryable_refusals_are_recognised_and_others_are_not():
    assert retryable(psycopg.errors.LockNotAvailable()) == "lock_not_available (lock_timeout)"
    wrapped = OperationalError("canceling statement due to statement timeout")
    wrapped.__cause__ = psycopg.errors.QueryCanceled()
    assert retryable(wrapped) == "query_canceled (statement_timeout)"
    assert retryable(psycopg.errors.UniqueViolation()) is None and retryable(ValueError("x")) is None


@pytest.mark.django_db(transaction=True)
def test_a_stuck_session_holding_the_task_row_is_ended_and_the_receipt_is_recorded(committed, refadmin):
    stuck = _other_session(idle_in_transaction_ms=1000)
    stuck.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [committed.pk])  # then idles
    outbox_dispatch_batch()  # the receipt on the outbox's rows: the task row is not needed for it
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.SUCCEEDED and refadmin.effects(action.idempotency_key) == 1
    assert settle_receipts() == 1  # the task's half needs its row: it waits until the server ends ``stuck``
    assert Task.objects.get(pk=committed.pk).state["receipt"]["external_id"] == action.external_id
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
        stuck.execute("SELECT 1")  # the server ended it
    stuck.close()


@pytest.mark.django_db(transaction=True)
def test_a_lock_wait_past_lock_timeout_is_refused_and_retried_without_a_second_ticket(committed, refadmin):
    holder = _other_session()  # not idle-limited: it holds the row until it commits
    holder.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE", [committed.pk])
    with connection.cursor() as cur:
        cur.execute("SET lock_timeout = '300ms'")
    try:
        outbox_dispatch_batch()  # sent, and the receipt recorded on the outbox's rows
        action = Action.objects.get(task=committed)
        assert refadmin.effects(action.idempotency_key) == 1
        assert action.status == ActionStatus.SUCCEEDED
        assert OutboxMessage.objects.get(action=action).status == OutboxStatus.DELIVERED
        # settling it on the task is refused by lock_timeout, together and then alone: logged, nothing written
        assert settle_receipts() == 0
        assert Task.objects.get(pk=committed.pk).state.get("receipt") is None
    finally:
        holder.rollback()
        holder.close()
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '10s'")
    assert settle_receipts() == 1  # the retry (the sweeper's agent step, or the next message)
    assert Task.objects.get(pk=committed.pk).state["receipt"]["external_id"] == action.external_id
    assert refadmin.effects(action.idempotency_key) == 1 and refadmin.requests(action.idempotency_key) == 1
    assert len(refadmin.tickets()) == 1


def test_a_celery_step_refused_by_the_database_is_retried(monkeypatch, committed):
    from apps.agent import runner as controller
    from apps.agent import tasks

    calls = []
    real = controller.agent_run

    def refused_once(*, task_id):
        calls.append(task_id)
        if len(calls) == 1:
            exc = OperationalError("canceling statement due to lock timeout")
            exc.__cause__ = psycopg.errors.LockNotAvailable()
            raise exc
        return real(task_id=task_id)

    monkeypatch.setattr(controller, "agent_run", refused_once)
    monkeypatch.setattr(tasks, "DATABASE_RETRY_DELAY", 0.0)
    result = tasks.agent_step.apply(args=[str(committed.pk)])
    assert result.successful(), result.traceback
    assert calls == [committed.pk, committed.pk]


def test_healthz_is_ok_with_its_figures(client, db):
    resp = client.get("/healthz")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok" and body["database"] is True and body["broker"] is True
    assert body["problems"] == [] and body["outbox_lag_seconds"] == 0.0


@pytest.mark.django_db(transaction=True)
def test_healthz_is_503_while_a_transaction_is_open_too_long(client, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "HEALTH_MAX_TRANSACTION_SECONDS": 0.2}
    old = _other_session()
    old.execute("SELECT pg_sleep(0.4)")  # a transaction begun 0.4 s ago, now idle in it
    try:
        resp = client.get("/healthz")
        assert resp.status_code == 503
        assert resp.json()["oldest_transaction_seconds"] >= 0.4
        assert any("a transaction has been open" in p for p in resp.json()["problems"])
        assert "faultdesk_healthy 0.0" in client.get("/metrics").content.decode()
    finally:
        old.rollback()
        old.close()
    assert client.get("/healthz").status_code == 200


def test_healthz_is_503_when_the_outbox_lags(client, committed):
    OutboxMessage.objects.filter(action__task=committed).update(available_at=timezone.now() - timedelta(minutes=10))
    resp = client.get("/healthz")
    assert resp.status_code == 503 and resp.json()["outbox_lag_seconds"] >= 600
    assert any("outbox" in p for p in resp.json()["problems"])
    metrics = client.get("/metrics").content.decode()
    lag = [line for line in metrics.splitlines() if line.startswith("faultdesk_outbox_lag_seconds ")]
    assert lag and float(lag[0].split()[1]) >= 600


def test_healthz_is_503_when_the_broker_does_not_answer(client, db, monkeypatch):
    from config.celery import app

    monkeypatch.setattr(app.conf, "broker_url", "redis://127.0.0.1:1/0")
    resp = client.get("/healthz")
    assert resp.status_code == 503 and resp.json()["broker"] is False
    assert 'faultdesk_up{component="broker"} 0.0' in client.get("/metrics").content.decode()


def test_metrics_are_computed_once_per_cache_period(client, db, settings, django_assert_num_queries):
    settings.FAULTDESK = {**settings.FAULTDESK, "METRICS_CACHE_SECONDS": 10}
    first = client.get("/metrics").content
    with django_assert_num_queries(0):
        assert client.get("/metrics").content == first
