"""Tampering with rows the database protects, for tests that show what happens when the
protection is gone (a restored backup, a privileged operator, a bug in a migration)."""

from __future__ import annotations

from contextlib import contextmanager

from django.db import connection


@contextmanager
def immutability_bypassed(*tables: str):
    """Disable the user triggers (the immutable-columns triggers) of ``tables`` for the block, in
    this test's connection; they are enabled again afterwards."""
    with connection.cursor() as cur:
        cur.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no pending (deferred) trigger events block ALTER
        for table in tables:
            cur.execute(f"ALTER TABLE {connection.ops.quote_name(table)} DISABLE TRIGGER USER")
    try:
        yield
    finally:
        with connection.cursor() as cur:
            cur.execute("SET CONSTRAINTS ALL IMMEDIATE")
            for table in tables:
                cur.execute(f"ALTER TABLE {connection.ops.quote_name(table)} ENABLE TRIGGER USER")
            cur.execute("SET CONSTRAINTS ALL DEFERRED")
