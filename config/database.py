"""PostgreSQL session timeouts (issue: no session may hold a row forever) and which refusals of
the database are worth a retry.

Every connection faultdesk opens sets, through its connection options:

* ``idle_in_transaction_session_timeout`` — a session that sits idle inside a transaction is ended
  by the server, and its row locks go with it (a stuck client cannot hold a task row while a
  dispatcher waits on it);
* ``statement_timeout`` — no statement runs longer;
* ``lock_timeout`` — no statement waits longer for a row or table lock.

The refusals these produce, and serialization failures and deadlocks, are *retryable*
(:func:`retryable`): the work is done again later (a Celery task retries, an outbox row's lease
expires and it is re-claimed); nothing half-written stays, because each ran in a transaction.
"""

from __future__ import annotations

#: SQLSTATEs of refusals that leave nothing written and succeed when tried again.
RETRYABLE_SQLSTATES = {
    "55P03": "lock_not_available (lock_timeout)",
    "57014": "query_canceled (statement_timeout)",
    "25P03": "idle_in_transaction_session_timeout",
    "40001": "serialization_failure",
    "40P01": "deadlock_detected",
}


#: Seconds a new connection may take before it fails (libpq ``connect_timeout``).
CONNECT_TIMEOUT_SECONDS = 5


def timeout_options(db: dict, *, statement_ms: int, lock_ms: int, idle_in_transaction_ms: int) -> dict:
    """``db`` (a Django DATABASES entry) with the three session timeouts added to its psycopg
    ``OPTIONS["options"]`` (milliseconds; 0 turns one off), and a ``connect_timeout`` of
    :data:`CONNECT_TIMEOUT_SECONDS` unless the URL sets one. Options the URL already carries stay."""
    options = dict(db.get("OPTIONS") or {})
    given = options.get("options", "")
    ours = (f"-c statement_timeout={int(statement_ms)} -c lock_timeout={int(lock_ms)} "
            f"-c idle_in_transaction_session_timeout={int(idle_in_transaction_ms)}")
    options["options"] = f"{given} {ours}".strip()
    options.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)  # an unreachable server is an error, soon
    return {**db, "OPTIONS": options}


def binding_options(db: dict, *, prepare_threshold: int) -> dict:
    """``db`` (a Django DATABASES entry) with its parameters bound by the server and its statements
    prepared: psycopg prepares a statement on a connection once it ran ``prepare_threshold`` times
    there (``0`` turns preparing off, as a transaction-pooling PgBouncer older than 1.21 needs), so
    the hot statements of a report are parsed and planned once per connection instead of at every
    run, and values (a task's state JSON) travel as parameters instead of quoted into the
    statement's text (docs/performance.md, "Prepared statements"). Options the URL already carries
    win."""
    options = {"server_side_binding": True, "prepare_threshold": prepare_threshold, **(db.get("OPTIONS") or {})}
    # psycopg reads 0 as "prepare at the first run" and None as "never": 0 here means off, from
    # the environment or from the URL (``?prepare_threshold=0``) alike.
    options["prepare_threshold"] = int(options["prepare_threshold"] or 0) or None
    return {**db, "OPTIONS": options}


def retryable(exc: BaseException, *, context: bool = True) -> str | None:
    """The name of the retryable refusal behind ``exc`` (a Django ``DatabaseError`` wrapping a
    psycopg error, or the psycopg error itself), or None when it is not one. ``context=False``
    follows only explicit causes (``raise … from``), not an exception that was merely being handled
    when ``exc`` was raised: ``exc`` must itself be the refusal."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        state = getattr(exc, "sqlstate", None)
        if state in RETRYABLE_SQLSTATES:
            return RETRYABLE_SQLSTATES[state]
        exc = exc.__cause__ or (exc.__context__ if context else None)
    return None
