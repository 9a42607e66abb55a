"""The second leg of a hybrid query on a connection of its own (DESIGN.md §9): the vector and
full-text rankings of :func:`apps.evidence.selectors.evidence_rank` run at the same time, so a
query costs about its slower leg rather than both.

Each process keeps one helper thread (made after a fork, never inherited) with its own database
connection, re-checked before every job as Django checks a request's (past ``CONN_MAX_AGE`` or
unusable: reconnect). A leg run there is its own read-only transaction: it cannot see the
caller's uncommitted rows, so :func:`apart_possible` says no inside a transaction, and the caller
then runs both legs on its own connection, one after the other.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from django.conf import settings
from django.db import connection, transaction

_POOLS: dict[int, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def apart_possible() -> bool:
    """Whether a leg may run on the helper connection: enabled by
    ``FAULTDESK["RETRIEVAL_PARALLEL_LEGS"]`` and the caller is in no transaction."""
    return bool(settings.FAULTDESK.get("RETRIEVAL_PARALLEL_LEGS", True)) and not connection.in_atomic_block


def _pool() -> ThreadPoolExecutor:
    pid = os.getpid()
    pool = _POOLS.get(pid)
    if pool is None:
        with _LOCK:
            pool = _POOLS.get(pid)
            if pool is None:
                _POOLS.clear()  # a parent's pool (before a fork) has no thread here
                pool = _POOLS[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval-leg")
    return pool


def _in_own_transaction(fn, kwargs: dict):
    connection.close_if_unusable_or_obsolete()
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET TRANSACTION READ ONLY")
        return fn(cur, **kwargs)


def run_apart(fn, **kwargs) -> Future:
    """Start ``fn(cur, **kwargs)`` on the helper thread, ``cur`` a cursor in a read-only
    transaction of the helper's connection; returns its future (``.result()`` re-raises what it
    raised). Call only when :func:`apart_possible`."""
    return _pool().submit(_in_own_transaction, fn, kwargs)


def close() -> None:
    """Close the helper's connection and stop its thread (tests; a process about to exit)."""
    with _LOCK:
        pool = _POOLS.pop(os.getpid(), None)
    if pool is not None:
        pool.submit(lambda: connection.close()).result()  # the helper's own connection
        pool.shutdown(wait=True)
