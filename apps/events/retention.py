"""Retention of the event log (spec agent-execution-system.md §16.12: sensitive payloads kept as
controlled references, the trace keeps digests; runtime-invariants.md §2.1 "trace 保留摘要、哈希").

Two purge levels, applied to the events, refused events and snapshots of tasks the caller has
already chosen and locked (``apps.tasks.retention`` decides *which* tasks; this module only
rewrites the event app's own rows):

- ``"excerpts"``: every value under a key in :data:`EXCERPT_KEYS` (evidence excerpts and the
  answer's quotes of them) is emptied, wherever it sits in a payload.
- ``"payload"``: the whole payload becomes ``{}``.

What always stays is the skeleton: ``task``, ``seq``, ``type``, ``payload_digest`` (the digest of
the payload *as written*), times, actor and lease generation — enough for replay to show that the
log is complete and in order, and report the task as purged instead of divergent. Snapshots are
deleted at either level: they are copies of state, and only an optimisation for replay.
"""

from __future__ import annotations

from django.db import connection

from apps.core.retention import PurgeCounts, Purged, column_sizes, strip_keys
from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot

EXCERPTS = "excerpts"
PAYLOAD = "payload"
#: The levels in order; a row at a level is never purged again to the same or a lower one.
LEVELS = ("", EXCERPTS, PAYLOAD)

#: Keys whose values are copies of document text: the evidence refs' ``excerpt`` and the
#: answer's ``quotes`` (lines cut from excerpts).
EXCERPT_KEYS = frozenset({"excerpt", "quotes"})


def level_rank(level: str) -> int:
    """0 for whole, 1 for ``excerpts``, 2 for ``payload``. Raises ``ValueError`` for another value."""
    return LEVELS.index(level)


def purge_task_events(task_ids: list, level: str, at) -> PurgeCounts:
    """Purge the events and refused events of ``task_ids`` to ``level`` and delete their
    snapshots. The caller holds the tasks' row locks (``SELECT … FOR UPDATE``) inside one
    transaction, so no event is appended meanwhile. Rows already at ``level`` or beyond are left.
    Returns the :class:`PurgeCounts`. Raises ``ValueError`` for an unknown level."""
    if level not in (EXCERPTS, PAYLOAD):
        raise ValueError(f"unknown purge level {level!r}")
    counts = PurgeCounts()
    if not task_ids:
        return counts
    lower = [lv for lv in LEVELS if level_rank(lv) < level_rank(level)]
    counts.add(TaskEvent._meta.db_table, _purge_rows(TaskEvent, task_ids, lower, level, at))
    counts.add(RefusedEvent._meta.db_table, _purge_rows(RefusedEvent, task_ids, lower, level, None))
    snaps = TaskSnapshot.objects.filter(task_id__in=task_ids)
    ids = list(snaps.values_list("id", flat=True))
    if ids:
        with connection.cursor() as cur:
            cur.execute(f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {TaskSnapshot._meta.db_table} t "  # noqa: S608
                        "WHERE id = ANY(%s)", [ids])
            freed = int(cur.fetchone()[0])
        deleted, _ = TaskSnapshot.objects.filter(id__in=ids).delete()
        counts.add(TaskSnapshot._meta.db_table, Purged(deleted, freed))
    return counts


def _purge_rows(model, task_ids: list, lower: list[str], level: str, at) -> Purged:
    table = model._meta.db_table
    rows = model.objects.filter(task_id__in=task_ids, purged__in=lower)
    if level == PAYLOAD:
        before = column_sizes(table, "payload", list(rows.values_list("id", flat=True)))
        if not before:
            return Purged()
        changes = {"payload": {}, "purged": PAYLOAD}
        if at is not None:
            changes["purged_at"] = at
        model.objects.filter(id__in=list(before)).update(**changes)
        after = column_sizes(table, "payload", list(before))
        return Purged(len(before), sum(before.values()) - sum(after.values()))
    # excerpts: only rows whose payload holds one of the keys change (and are marked, so replay
    # knows their digest no longer matches); the task's own marker keeps the rest from being
    # looked at again.
    done = Purged()
    changes = {"purged": EXCERPTS}
    if at is not None:
        changes["purged_at"] = at
    for pk, payload in rows.values_list("id", "payload"):
        stripped = strip_keys(payload, EXCERPT_KEYS)
        if stripped != payload:
            before = column_sizes(table, "payload", [pk])[pk]
            model.objects.filter(id=pk).update(payload=stripped, **changes)
            done.rows += 1
            done.bytes += before - column_sizes(table, "payload", [pk])[pk]
    return done
