"""What every app's retention step shares (DESIGN.md §13 "Retention"): the count of what a purge
step did, JSON redaction, and deleting one batch of rows without waiting for a lock.

Each app purges its own rows (``apps.<app>.retention``); ``apps.retention`` decides when, per
tenant policy, and records the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connection, transaction


@dataclass
class Purged:
    """What one purge step did to one table: rows changed or deleted, and bytes of column data
    freed (``pg_column_size`` before minus after; for a deleted row, its whole size)."""

    rows: int = 0
    bytes: int = 0

    def add(self, other: Purged) -> None:
        self.rows += other.rows
        self.bytes += other.bytes


@dataclass
class PurgeCounts:
    """Per-table :class:`Purged`, keyed by database table name."""

    tables: dict[str, Purged] = field(default_factory=dict)

    def add(self, table: str, purged: Purged) -> None:
        self.tables.setdefault(table, Purged()).add(purged)

    def merge(self, other: PurgeCounts) -> None:
        for table, purged in other.tables.items():
            self.add(table, purged)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {t: {"rows": p.rows, "bytes": p.bytes} for t, p in sorted(self.tables.items())}


def emptied(value):
    """The empty value of ``value``'s JSON type: ``""``, ``[]``, ``{}``, or ``None`` (numbers and
    booleans are kept: they carry no text)."""
    if isinstance(value, str):
        return ""
    if isinstance(value, list):
        return []
    if isinstance(value, dict):
        return {}
    if isinstance(value, bool | int | float):
        return value
    return None


def strip_keys(value, keys: frozenset[str]):
    """A copy of the JSON ``value`` with the value under every key in ``keys``, at any depth,
    replaced by :func:`emptied`. Pure; the input is not changed."""
    if isinstance(value, dict):
        return {k: (emptied(v) if k in keys else strip_keys(v, keys)) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_keys(v, keys) for v in value]
    return value


def column_sizes(table: str, column: str, ids: list) -> dict:
    """``{id: bytes}`` for the rows ``ids`` of ``table``: ``pg_column_size`` of each of ``column``'s
    comma-separated columns, summed (bytes as stored, after compression). ``table`` and
    ``column`` are code constants, never input."""
    if not ids:
        return {}
    with connection.cursor() as cur:
        size = " + ".join(f"coalesce(pg_column_size({c.strip()}), 0)" for c in column.split(","))
        cur.execute(f"SELECT id, {size} FROM {table} WHERE id = ANY(%s)", [ids])  # noqa: S608 - names are constants
        return dict(cur.fetchall())


def delete_batch(queryset, limit: int) -> Purged:
    """Delete up to ``limit`` rows of ``queryset`` that no other transaction holds
    (``FOR UPDATE SKIP LOCKED``), in one short transaction. Returns the rows deleted and their
    bytes (``pg_column_size`` of the whole row). Related rows the model cascades to are deleted
    by Django as usual; a ``PROTECT`` reference raises ``ProtectedError`` and deletes nothing."""
    model = queryset.model
    with transaction.atomic():
        ids = list(queryset.select_for_update(skip_locked=True, of=("self",))
                   .order_by("pk").values_list("pk", flat=True)[:limit])
        if not ids:
            return Purged()
        table = model._meta.db_table
        with connection.cursor() as cur:
            cur.execute(f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {table} t "  # noqa: S608 - a model's table
                        f"WHERE {model._meta.pk.column} = ANY(%s)", [ids])
            freed = int(cur.fetchone()[0])
        model.objects.filter(pk__in=ids).delete()
        return Purged(len(ids), freed)
