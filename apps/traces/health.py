"""Readiness (``/healthz``) and its figures on ``/metrics``: PostgreSQL answers, the broker
answers, no transaction has been open too long (a stuck session holding row locks), and the
outbox is not falling behind. Read at request time; a few milliseconds each."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import connection

log = logging.getLogger(__name__)

OLDEST_TRANSACTION_SQL = (
    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL "
    "AND backend_type = 'client backend'")
OUTBOX_LAG_SQL = (
    "SELECT coalesce(extract(epoch FROM clock_timestamp() - min(available_at)), 0) FROM outbox_outboxmessage "
    "WHERE status = 'PENDING' AND available_at <= clock_timestamp()")


@dataclass(frozen=True)
class Health:
    """``database`` and ``broker``: True when they answered. ``oldest_transaction_seconds``: age of
    the oldest open transaction of another session of this database. ``outbox_lag_seconds``: how
    long the oldest due outbox row has waited. ``problems``: each figure past its limit, named."""

    database: bool
    broker: bool
    oldest_transaction_seconds: float
    outbox_lag_seconds: float
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {"status": "ok" if self.ok else "unavailable", "database": self.database, "broker": self.broker,
                "oldest_transaction_seconds": round(self.oldest_transaction_seconds, 3),
                "outbox_lag_seconds": round(self.outbox_lag_seconds, 3), "problems": list(self.problems)}


def _broker_answers() -> bool:
    from config.celery import app

    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=0, timeout=2)
        return True
    except Exception as exc:  # noqa: BLE001 - any failure to reach the broker is "not ready"
        log.warning("health: the broker does not answer: %r", exc)
        return False


def health_check() -> Health:
    """Run every check; limits ``FAULTDESK["HEALTH_MAX_TRANSACTION_SECONDS"]`` and
    ``FAULTDESK["HEALTH_MAX_OUTBOX_LAG_SECONDS"]``. Never raises."""
    conf = settings.FAULTDESK
    problems = []
    database, oldest, lag = True, 0.0, 0.0
    try:
        with connection.cursor() as cur:
            cur.execute(OLDEST_TRANSACTION_SQL)
            oldest = float(cur.fetchone()[0])
            cur.execute(OUTBOX_LAG_SQL)
            lag = float(cur.fetchone()[0])
    except Exception as exc:  # noqa: BLE001 - a database that does not answer is "not ready"
        log.warning("health: PostgreSQL does not answer: %r", exc)
        database = False
        problems.append("database: PostgreSQL does not answer")
    broker = _broker_answers()
    if not broker:
        problems.append("broker: it does not answer")
    if oldest > conf["HEALTH_MAX_TRANSACTION_SECONDS"]:
        problems.append(f"a transaction has been open {oldest:.0f} s "
                        f"(limit {conf['HEALTH_MAX_TRANSACTION_SECONDS']} s)")
    if lag > conf["HEALTH_MAX_OUTBOX_LAG_SECONDS"]:
        problems.append(f"the oldest due outbox row has waited {lag:.0f} s "
                        f"(limit {conf['HEALTH_MAX_OUTBOX_LAG_SECONDS']} s)")
    return Health(database, broker, oldest, lag, tuple(problems))
