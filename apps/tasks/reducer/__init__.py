"""The reducer δ and its versions (DESIGN.md §4; spec §16.3): ``S_k = δ(S_{k-1}, e_k)``, a pure
function over JSON-shaped state and events. The shared kernel is :mod:`.core` (statuses, the
refusal, the guard, the ledger's admission check); each version is a module — :mod:`.v1`,
:mod:`.v2` (comments on an open ticket, conflicts, compensation), :mod:`.v3` (the budget ledger and
recorded model calls), :mod:`.v4` (service-level breaches), :mod:`.v5` (a rejection remembered by the
action's identity, not its wording), :mod:`.v6` (plan versions, premises, parallel reads) —
importing only the kernel and the versions before it. This package is the registry: which versions
this build carries, which one new tasks get, the migrations, and what each version supports
(:func:`supports`), so callers ask "does this task's reducer have a ledger?" instead of comparing
version strings.

The state table (legal transitions) is documented in ``docs/task-lifecycle.md``.
"""

from __future__ import annotations

from collections.abc import Callable

from apps.tasks.reducer import v1, v2, v3, v4, v5, v6
from apps.tasks.reducer.core import (  # noqa: F401 - the kernel, re-exported for callers
    ACCEPTED,
    ALL_STATUSES,
    CANCELLED,
    COMPENSATING,
    COMPLETED,
    DISPATCHING,
    FAILED,
    NON_TERMINAL,
    PROPOSING,
    RETRIEVING,
    STATUSES,
    TERMINAL,
    VALIDATING,
    WAITING,
    WAITING_APPROVAL,
    WAITING_COMPENSATION,
    WAITING_INPUT,
    WAITING_RECONCILIATION,
    IllegalTransition,
    Status,
    UnknownReducer,
    reduce_with,
)
from apps.tasks.reducer.v1 import EVENT_TYPES, TRANSITIONS, initial_state, reduce, replay  # noqa: F401 - reducer/1

#: the version a task without a pinned version has
REDUCER_VERSION = v1.VERSION

# --- versions ----------------------------------------------------------------------------------
# A task is replayed (and continued) with the reducer version pinned in its artifact bundle. When a
# version is retired, its tasks need an explicit migration of their events to a version this build
# carries: never a silent replay with new logic (DESIGN.md §4).

#: Reducer versions this build carries. A task without a pinned version is a ``reducer/1`` task.
REDUCERS: dict[str, Callable[[dict, str, dict], dict]] = {v1.VERSION: v1.reduce, v2.VERSION: v2.reduce,
                                                          v3.VERSION: v3.reduce, v4.VERSION: v4.reduce,
                                                          v5.VERSION: v5.reduce, v6.VERSION: v6.reduce}

#: The version new tasks are pinned to: ``reducer/6`` (plan versions, the reads side by side; ADR 0023).
#: Tasks pinned to an earlier version keep it, with their sequential reads; tests of what only those
#: versions do pin ``CURRENT`` back for the tasks they create.
CURRENT = v6.VERSION

#: Explicit migrations: old version -> (target version, function mapping the old ``(type, payload)``
#: event list to the target version's events). Empty while only ``reducer/1`` exists.
MIGRATIONS: dict[str, tuple[str, Callable[[list[tuple[str, dict]]], list[tuple[str, dict]]]]] = {}


def reducer_for(version: str | None) -> Callable[[dict, str, dict], dict]:
    """The reducer for ``version`` (None means the current one). Raises :class:`UnknownReducer`."""
    version = version or REDUCER_VERSION
    if version not in REDUCERS:
        raise UnknownReducer(f"no reducer {version!r} in this build; migrate the task's events first")
    return REDUCERS[version]


def migrate_events(version: str, events: list[tuple[str, dict]]) -> tuple[str, list[tuple[str, dict]]]:
    """Apply the registered migrations from ``version`` until a carried version is reached.
    Returns ``(version, events)``. Raises :class:`UnknownReducer` when no path exists."""
    seen = set()
    while version not in REDUCERS:
        if version in seen or version not in MIGRATIONS:
            raise UnknownReducer(f"no reducer or migration for {version!r}")
        seen.add(version)
        version, fn = MIGRATIONS[version][0], MIGRATIONS[version][1]
        events = fn(events)
    return version, events


#: What each version's plan and state carry beyond ``reducer/1``'s: ``comments`` (a comment on
#: the device's open ticket, conditional on its version; conflicts re-plan), ``compensation`` (a
#: ticket created although its request was cancelled is closed by an approved update), ``ledger``
#: (the budget ledger over cost units, tokens, tool calls and retries, and recorded model calls),
#: ``sla`` (service-level breaches recorded as events) and ``coalesce`` (one ticket per fault: a
#: create deferred behind another report's, ``intent.deferred``), both ``reducer/4``;
#: ``rejection_identity`` (a rejected action stays refused however it is re-worded), ``reducer/5``;
#: ``plans`` (plan versions with premises, a barrier at each re-plan, the reads as parallel activities
#: joined by premise), ``reducer/6``.
FEATURES: dict[str, frozenset[str]] = {
    v1.VERSION: frozenset(),
    v2.VERSION: frozenset({"comments", "compensation"}),
    v3.VERSION: frozenset({"comments", "compensation", "ledger"}),
    v4.VERSION: frozenset({"comments", "compensation", "ledger", "sla", "coalesce"}),
    v5.VERSION: frozenset({"comments", "compensation", "ledger", "sla", "coalesce", "rejection_identity"}),
    v6.VERSION: frozenset({"comments", "compensation", "ledger", "sla", "coalesce", "rejection_identity", "plans"}),
}


def supports(version: str | None, feature: str) -> bool:
    """Does the reducer ``version`` (None: a task pinned to none, i.e. ``reducer/1``) have
    ``feature`` (a key of :data:`FEATURES`'s sets)? An unknown version supports nothing."""
    return feature in FEATURES.get(version or REDUCER_VERSION, frozenset())


#: versions with ``reducer/2``'s plan (comments, conflicts, compensation) — ``reducer/3`` adds the ledger
V2_PLAN = tuple(version for version, features in FEATURES.items() if "comments" in features)
