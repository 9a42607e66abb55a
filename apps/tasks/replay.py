"""Replay: rebuild a task's state from its newest valid snapshot and the later events, and compare
it with the materialized task row (DESIGN.md §4, invariant 7: ``replay(events) == state``).

Replay uses the reducer version pinned in the task's artifact bundle; a task pinned to a reducer
this code does not carry is reported, never replayed silently with new logic.
"""

from __future__ import annotations

from dataclasses import dataclass

import rfc8785

from apps.core.digests import sha256_json
from apps.events.models import TaskEvent, TaskSnapshot
from apps.tasks import reducer


@dataclass(frozen=True)
class ReplayResult:
    """``ok`` when the rebuilt state equals the task row. Otherwise ``divergent_seq`` names the
    first event whose result differs (or the event δ refused), and ``detail`` says how."""

    task_id: str
    ok: bool
    events: int
    from_snapshot: int | None
    divergent_seq: int | None = None
    detail: str = ""
    #: the purge level (``excerpts`` or ``payload``) when retention purged the task: its state
    #: cannot be rebuilt, so only its event skeleton was checked (``ok`` says whether it held)
    purged: str = ""


def _replay_migrated(task, pinned: str) -> ReplayResult:
    """Replay a task pinned to a retired reducer through its explicit event migration."""
    raw = [(e.type, e.payload) for e in TaskEvent.objects.filter(task_id=task.pk).order_by("seq")]
    try:
        version, events = reducer.migrate_events(pinned, raw)
        reduce, state = reducer.reducer_for(version), reducer.initial_state()
        for event_type, payload in events:
            state = reduce(state, event_type, payload)
        reduce_ok = state == task.state and state["status"] == task.status
    except (reducer.UnknownReducer, reducer.IllegalTransition) as exc:
        return ReplayResult(str(task.pk), False, len(raw), None, None, str(exc))
    detail = f"migrated {pinned} → {version}"
    return ReplayResult(str(task.pk), reduce_ok, len(raw), None, None if reduce_ok else len(raw),
                        detail if reduce_ok else f"{detail}; differs from the row")


def _row_state(task) -> dict:
    return {
        "status": task.status,
        "version": task.version,
        "budget": [task.budget_total, task.budget_used, task.budget_reserved],
        "state": task.state,
    }


def _digest(value) -> str | None:
    """:func:`sha256_json` of ``value`` as read back from the database, or None when it has no
    canonical form any more: jsonb keeps numbers as numerics, so a float of 2**53 or more written
    by an event comes back as an integer beyond JCS's range."""
    try:
        return sha256_json(value)
    except rfc8785.CanonicalizationError:
        return None


def _skeleton_check(task) -> ReplayResult:
    """A purged task (apps.tasks.retention): its state is not rebuilt, but its event skeleton is
    checked — seq 1..version with no gap, a digest on every event, the digest still matching
    every payload the purge did not touch."""
    rows = list(TaskEvent.objects.filter(task_id=task.pk).order_by("seq")
                .values_list("seq", "type", "payload", "payload_digest", "purged"))
    detail = f"purged ({task.purged}) on {task.purged_at:%Y-%m-%d}: event skeleton checked, state not rebuilt"
    for expected, (seq, etype, payload, digest, purged) in enumerate(rows, start=1):
        if seq != expected:
            return ReplayResult(str(task.pk), False, len(rows), None, seq,
                                f"{detail}; gap in the event log: expected seq {expected}, found {seq}", task.purged)
        if not etype or len(digest or "") != 64:
            return ReplayResult(str(task.pk), False, len(rows), None, seq, f"{detail}; event without type or digest",
                                task.purged)
        if not purged and _digest(payload) != digest:
            return ReplayResult(str(task.pk), False, len(rows), None, seq, f"{detail}; payload digest mismatch",
                                task.purged)
    if len(rows) != task.version:
        return ReplayResult(str(task.pk), False, len(rows), None, len(rows),
                            f"{detail}; {len(rows)} events for version {task.version}", task.purged)
    return ReplayResult(str(task.pk), True, len(rows), None, detail=detail, purged=task.purged)


def task_replay(task, *, use_snapshot: bool = True) -> ReplayResult:
    """Replay ``task`` and compare with its row. Never writes. See :class:`ReplayResult`. A task
    retention purged is reported ``purged`` with its event skeleton checked, never as divergent."""
    if getattr(task, "purged", ""):
        return _skeleton_check(task)
    pinned = (task.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION)
    if pinned not in reducer.REDUCERS:
        return _replay_migrated(task, pinned)
    reduce = reducer.reducer_for(pinned)
    state, start_seq, snap_seq = reducer.initial_state(), 0, None
    if use_snapshot:
        snap = TaskSnapshot.objects.filter(task_id=task.pk).order_by("-seq").first()
        if snap is not None and _digest(snap.state) == snap.digest and snap.reducer_version == pinned:
            state, start_seq, snap_seq = snap.state, snap.seq, snap.seq
    events = list(TaskEvent.objects.filter(task_id=task.pk, seq__gt=start_seq).order_by("seq"))
    expected_seq = start_seq
    for e in events:
        expected_seq += 1
        if e.seq != expected_seq:
            return ReplayResult(str(task.pk), False, len(events), snap_seq, e.seq,
                                f"gap in the event log: expected seq {expected_seq}, found {e.seq}")
        digest = _digest(e.payload)
        if digest is None:
            return ReplayResult(str(task.pk), False, len(events), snap_seq, e.seq,
                                "payload no longer has a canonical form (e.g. a float of 2**53 or more that jsonb "
                                "stored as an integer JSON cannot carry)")
        if digest != e.payload_digest:
            return ReplayResult(str(task.pk), False, len(events), snap_seq, e.seq, "payload digest mismatch")
        try:
            state = reduce(state, e.type, e.payload)
        except reducer.IllegalTransition as exc:
            return ReplayResult(str(task.pk), False, len(events), snap_seq, e.seq, f"δ refuses {e.type}: {exc.reason}")
    rebuilt = {
        "status": state["status"],
        "version": expected_seq,
        "budget": [state["budget"]["total"], state["budget"]["used"], state["budget"]["reserved"]],
        "state": state,
    }
    row = _row_state(task)
    if rebuilt == row:
        return ReplayResult(str(task.pk), True, len(events), snap_seq)
    diffs = [k for k in rebuilt if rebuilt[k] != row[k]]
    # Every event was legal, so the row departed from the log: it either missed events (the first
    # one it missed) or holds a state no event produced (the last event is where they part).
    first = row["version"] + 1 if row["version"] < expected_seq else expected_seq
    return ReplayResult(str(task.pk), False, len(events), snap_seq, first, f"differs in {diffs}")
