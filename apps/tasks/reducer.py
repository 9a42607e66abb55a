"""The reducer δ: ``S_k = δ(S_{k-1}, e_k)`` (DESIGN.md §4; spec §16.3).

A pure function over JSON-shaped state and events: no I/O, no clock, no randomness. Model outputs,
retrieval results, device reads and times enter only through event payloads. An event that is
illegal in the current state raises :class:`IllegalTransition`; the caller records it as refused
and never applies it.

State (a ``dict``, stored on the task row and rebuilt by replay)::

    {"status": str, "request": {...}, "budget": {"total": int, "used": int, "reserved": int},
     "evidence": [ref, ...] | None, "device": reading | None, "draft": {...} | None,
     "redrafts": int, "replans": int, "proposal": {...} | None, "approval": {...} | None,
     "rejected_digests": [str], "questions": [str] | None, "answers": [str],
     "action": {...} | None, "receipt": {...} | None, "answer": {...} | None,
     "termination_reason": str | None, "cancel_requested": bool}

The state table (legal transitions) is :data:`TRANSITIONS` and is documented in
``docs/task-lifecycle.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

REDUCER_VERSION = "reducer/1"

ACCEPTED = "ACCEPTED"
RETRIEVING = "RETRIEVING"
PROPOSING = "PROPOSING"
VALIDATING = "VALIDATING"
WAITING_INPUT = "WAITING_INPUT"
WAITING_APPROVAL = "WAITING_APPROVAL"
DISPATCHING = "DISPATCHING"
WAITING_RECONCILIATION = "WAITING_RECONCILIATION"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"

STATUSES = (
    ACCEPTED, RETRIEVING, PROPOSING, VALIDATING, WAITING_INPUT, WAITING_APPROVAL, DISPATCHING,
    WAITING_RECONCILIATION, COMPLETED, FAILED, CANCELLED,
)
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})
NON_TERMINAL = tuple(s for s in STATUSES if s not in TERMINAL)

# Statuses only ``reducer/2`` (apps.tasks.reducer_v2) reaches: a cancelled task closing the ticket it
# created anyway (a compensation), and a failed compensation waiting for a person.
COMPENSATING = "COMPENSATING"
WAITING_COMPENSATION = "WAITING_COMPENSATION"
#: every status of every carried reducer version (model choices, API filters)
ALL_STATUSES = (*STATUSES, COMPENSATING, WAITING_COMPENSATION)
WAITING = frozenset({WAITING_INPUT, WAITING_APPROVAL, WAITING_RECONCILIATION, WAITING_COMPENSATION})


class IllegalTransition(Exception):
    """δ refuses ``event_type`` in ``status``; ``reason`` says why."""

    def __init__(self, status: str | None, event_type: str, reason: str):
        super().__init__(f"{event_type} refused in {status}: {reason}")
        self.status = status
        self.event_type = event_type
        self.reason = reason


def initial_state() -> dict:
    """The state before the first event (status ``None``)."""
    return {
        "status": None,
        "request": None,
        "budget": {"total": 0, "used": 0, "reserved": 0},
        "evidence": None,
        "device": None,
        "draft": None,
        "redrafts": 0,
        "replans": 0,
        "proposal": None,
        "approval": None,
        "rejected_digests": [],
        "questions": None,
        "answers": [],
        "action": None,
        "receipt": None,
        "answer": None,
        "termination_reason": None,
        "cancel_requested": False,
    }


def _require(cond: bool, s: dict, etype: str, reason: str) -> None:
    if not cond:
        raise IllegalTransition(s["status"], etype, reason)


# --- handlers: (state copy, payload) -> None, mutate the copy ---------------------------------

def _accepted(s: dict, p: dict) -> None:
    s["status"] = ACCEPTED
    s["request"] = p["request"]
    s["budget"] = {"total": int(p["budget_total"]), "used": 0, "reserved": 0}


def _retrieval_started(s: dict, p: dict) -> None:
    s["status"] = RETRIEVING


def _evidence_retrieved(s: dict, p: dict) -> None:
    _require(s["evidence"] is None, s, "evidence.retrieved", "evidence already recorded for this plan")
    s["evidence"] = p["refs"]
    if "selection" in p:
        # What the relevance check decided (answered / no_procedure, why, the withheld count); an
        # event without it (recorded before the check existed) leaves the state as it was.
        s["selection"] = p["selection"]


def _device_read(s: dict, p: dict) -> None:
    _require(s["evidence"] is not None, s, "device.read", "retrieval must be recorded before the device read")
    s["device"] = p["reading"]
    s["status"] = PROPOSING


def _draft_proposed(s: dict, p: dict) -> None:
    s["draft"] = p["draft"]
    s["status"] = VALIDATING


def _draft_invalid(s: dict, p: dict) -> None:
    s["redrafts"] += 1
    s["draft"] = None
    s["status"] = PROPOSING


def _input_requested(s: dict, p: dict) -> None:
    s["questions"] = p["questions"]
    s["status"] = WAITING_INPUT


def _input_provided(s: dict, p: dict) -> None:
    s["answers"] = [*s["answers"], p["text"]]
    s["questions"] = None
    s["replans"] += 1
    # Re-plan from fresh premises: new evidence, a new device read and a new draft.
    s["evidence"] = None
    s.pop("selection", None)
    s["device"] = None
    s["draft"] = None
    s["status"] = RETRIEVING


def _approval_requested(s: dict, p: dict) -> None:
    digest = p["proposal"]["digest"]
    _require(digest not in s["rejected_digests"], s, "approval.requested",
             "this exact action was rejected earlier in the task")
    s["proposal"] = p["proposal"]
    s["approval"] = {
        "id": p["approval_id"],
        "status": "PENDING",
        "digest": digest,
        "object_version": p["object_version"],
        "policy_version": p["policy_version"],
        "expires_at": p["expires_at"],
    }
    s["status"] = WAITING_APPROVAL


def _approval_granted(s: dict, p: dict) -> None:
    a = s["approval"]
    _require(a is not None and a["id"] == p["approval_id"], s, "approval.granted", "not the pending approval")
    _require(a["status"] == "PENDING", s, "approval.granted", f"approval is {a['status']}")
    s["approval"] = {**a, "status": "APPROVED", "decided_by": p["decided_by"]}


def _approval_rejected(s: dict, p: dict) -> None:
    a = s["approval"]
    _require(a is not None and a["id"] == p["approval_id"], s, "approval.rejected", "not the pending approval")
    _require(a["status"] == "PENDING", s, "approval.rejected", f"approval is {a['status']}")
    s["approval"] = {**a, "status": "REJECTED", "decided_by": p["decided_by"], "reason": p.get("reason", "")}
    s["rejected_digests"] = [*s["rejected_digests"], a["digest"]]
    s["proposal"] = None
    s["draft"] = None
    s["status"] = PROPOSING


def _approval_invalidated(s: dict, p: dict) -> None:
    a = s["approval"]
    _require(a is not None and a["id"] == p["approval_id"], s, "approval.invalidated", "not the current approval")
    _require(s["action"] is None or s["status"] == DISPATCHING, s, "approval.invalidated", "action already sent")
    if s["status"] == DISPATCHING:
        _require(p.get("action_not_sent") is True, s, "approval.invalidated", "an action was committed")
        budget = s["budget"]
        s["budget"] = {**budget, "reserved": budget["reserved"] - int(s["action"]["reservation"])}
        s["action"] = None
    s["approval"] = {**a, "status": "INVALIDATED", "reason": p["reason"]}
    s["replans"] += 1
    s["proposal"] = None
    s["draft"] = None
    s["evidence"] = None
    s["device"] = None
    s["status"] = RETRIEVING


def _intent_committed(s: dict, p: dict) -> None:
    _require(s["action"] is None, s, "intent.committed", "an action is already committed")
    if s["status"] == WAITING_APPROVAL:
        a = s["approval"]
        _require(a is not None and a["status"] == "APPROVED", s, "intent.committed", "approval not granted")
        _require(a["digest"] == p["digest"], s, "intent.committed", "digest differs from the approved one")
    else:
        _require(p.get("approval_required") is False, s, "intent.committed", "this action needs an approval")
        _require(p["digest"] not in s["rejected_digests"], s, "intent.committed", "action was rejected earlier")
    r = int(p["reservation"])
    b = s["budget"]
    _require(r >= 0 and b["used"] + b["reserved"] + r <= b["total"], s, "intent.committed",
             f"budget: U+R+r = {b['used']}+{b['reserved']}+{r} exceeds B={b['total']}")
    s["budget"] = {**b, "reserved": b["reserved"] + r}
    if p.get("proposal") is not None:
        s["proposal"] = p["proposal"]
    s["action"] = {
        "id": p["action_id"],
        "idempotency_key": p["idempotency_key"],
        "digest": p["digest"],
        "reservation": r,
        "status": "INTENDED",
    }
    s["status"] = DISPATCHING


def _settle(s: dict, cost: int) -> None:
    b = s["budget"]
    r = int(s["action"]["reservation"])
    if cost < 0 or cost > r:
        raise IllegalTransition(s["status"], "receipt.recorded", f"cost {cost} outside [0, reservation {r}]")
    s["budget"] = {**b, "used": b["used"] + cost, "reserved": b["reserved"] - r}
    s["action"] = {**s["action"], "reservation": 0}


def _receipt_recorded(s: dict, p: dict) -> None:
    _require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "receipt.recorded",
             "receipt for an action this task did not commit")
    _require(s["receipt"] is None, s, "receipt.recorded", "receipt already recorded")
    _settle(s, int(p["cost"]))
    s["receipt"] = p["receipt"]
    s["action"] = {**s["action"], "status": "SUCCEEDED"}
    if s["status"] == WAITING_RECONCILIATION:
        s["status"] = DISPATCHING
    # In CANCELLED the status stays: cancel stops the future, it does not undo the past.


def _outcome_unknown(s: dict, p: dict) -> None:
    _require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "outcome.unknown", "unknown action")
    _require(s["receipt"] is None, s, "outcome.unknown", "the receipt is already recorded (a stale dispatcher)")
    s["action"] = {**s["action"], "status": "UNKNOWN"}
    if s["status"] == DISPATCHING:
        s["status"] = WAITING_RECONCILIATION


def _reconciliation_retry(s: dict, p: dict) -> None:
    _require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "reconciliation.retry",
             "unknown action")
    s["action"] = {**s["action"], "status": "INTENDED"}
    s["status"] = DISPATCHING


def _dispatch_failed(s: dict, p: dict) -> None:
    _require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "dispatch.failed", "unknown action")
    b = s["budget"]
    s["budget"] = {**b, "reserved": b["reserved"] - int(s["action"]["reservation"])}
    s["action"] = {**s["action"], "status": "FAILED", "reservation": 0, "error": p["error"]}
    if s["status"] != CANCELLED:
        s["status"] = FAILED
        s["termination_reason"] = f"dispatch_failed: {p['error']}"


def _task_completed(s: dict, p: dict) -> None:
    reason = p["reason"]
    if s["status"] == DISPATCHING:
        _require(s["receipt"] is not None, s, "task.completed", "no receipt: a task never shows created without one")
    else:
        _require(s["action"] is None, s, "task.completed", "an action is in flight")
        _require(reason in ("proposal_rejected", "no_action_needed"), s, "task.completed",
                 f"reason {reason!r} needs a receipt")
    s["answer"] = p["answer"]
    s["termination_reason"] = reason
    s["status"] = COMPLETED


def _task_failed(s: dict, p: dict) -> None:
    _require(s["action"] is None or s["action"]["status"] in ("FAILED", "SUCCEEDED"), s, "task.failed",
             "an action is in flight or unknown: reconcile it first")
    s["termination_reason"] = p["reason"]
    s["status"] = FAILED


def _cancel_requested(s: dict, p: dict) -> None:
    s["cancel_requested"] = True
    s["termination_reason"] = f"cancelled: {p.get('reason') or 'by request'}"
    s["status"] = CANCELLED
    # A committed action keeps its reservation until its outcome is recorded (sent or not).


Handler = Callable[[dict, dict], None]

#: The state table: event type -> (statuses in which it is legal, handler).
TRANSITIONS: dict[str, tuple[frozenset, Handler]] = {
    "task.accepted": (frozenset({None}), _accepted),
    "retrieval.started": (frozenset({ACCEPTED}), _retrieval_started),
    "evidence.retrieved": (frozenset({RETRIEVING}), _evidence_retrieved),
    "device.read": (frozenset({RETRIEVING}), _device_read),
    "draft.proposed": (frozenset({PROPOSING}), _draft_proposed),
    "draft.invalid": (frozenset({VALIDATING}), _draft_invalid),
    "input.requested": (frozenset({VALIDATING}), _input_requested),
    "input.provided": (frozenset({WAITING_INPUT}), _input_provided),
    "approval.requested": (frozenset({VALIDATING}), _approval_requested),
    "approval.granted": (frozenset({WAITING_APPROVAL}), _approval_granted),
    "approval.rejected": (frozenset({WAITING_APPROVAL}), _approval_rejected),
    "approval.invalidated": (frozenset({WAITING_APPROVAL, DISPATCHING}), _approval_invalidated),
    "intent.committed": (frozenset({VALIDATING, WAITING_APPROVAL}), _intent_committed),
    "receipt.recorded": (frozenset({DISPATCHING, WAITING_RECONCILIATION, CANCELLED}), _receipt_recorded),
    "outcome.unknown": (frozenset({DISPATCHING, CANCELLED}), _outcome_unknown),
    "reconciliation.retry": (frozenset({WAITING_RECONCILIATION}), _reconciliation_retry),
    "dispatch.failed": (frozenset({DISPATCHING, WAITING_RECONCILIATION, CANCELLED}), _dispatch_failed),
    "task.completed": (frozenset({DISPATCHING, PROPOSING, VALIDATING}), _task_completed),
    "task.failed": (frozenset(NON_TERMINAL), _task_failed),
    "cancel.requested": (frozenset(NON_TERMINAL), _cancel_requested),
}
EVENT_TYPES = tuple(TRANSITIONS)


def reduce(state: dict, event_type: str, payload: dict) -> dict:
    """δ: return the next state for ``event_type`` with ``payload`` applied to ``state``.

    Never mutates ``state``. Raises :class:`IllegalTransition` when the event is unknown, illegal
    in the current status, or violates a guard (e.g. a receipt for another action, a budget
    reservation with ``U + R + r > B``, "completed" without a receipt).
    """
    return reduce_with(TRANSITIONS, state, event_type, payload)


def reduce_with(transitions: dict, state: dict, event_type: str, payload: dict) -> dict:
    """δ over the state table ``transitions`` (event type -> (legal statuses, handler)): the shared
    body of every reducer version. Raises :class:`IllegalTransition`."""
    entry = transitions.get(event_type)
    status = state.get("status")
    if entry is None:
        raise IllegalTransition(status, event_type, "unknown event type")
    legal_in, handler = entry
    if status not in legal_in:
        if status in TERMINAL:
            raise IllegalTransition(status, event_type, "task is terminal")
        raise IllegalTransition(status, event_type, f"not legal in {status}")
    nxt = copy.deepcopy(state)
    handler(nxt, payload)
    b = nxt["budget"]
    if b["used"] + b["reserved"] > b["total"] or b["reserved"] < 0:
        raise IllegalTransition(status, event_type, f"budget invariant broken: {b}")
    return nxt


def replay(events: list[tuple[str, dict]], *, start: dict | None = None) -> dict:
    """Fold δ over ``events`` (``(type, payload)`` pairs in seq order) from ``start`` (default
    :func:`initial_state`). Raises :class:`IllegalTransition` on the first illegal event."""
    state = copy.deepcopy(start) if start is not None else initial_state()
    for event_type, payload in events:
        state = reduce(state, event_type, payload)
    return state


# --- versions ----------------------------------------------------------------------------------
# A task is replayed (and continued) with the reducer version pinned in its artifact bundle. When a
# version is retired, its tasks need an explicit migration of their events to a version this build
# carries: never a silent replay with new logic (DESIGN.md §4).

#: Reducer versions this build carries. A task without a pinned version is a ``reducer/1`` task.
REDUCERS: dict[str, Callable[[dict, str, dict], dict]] = {REDUCER_VERSION: reduce}

#: The version new tasks are pinned to (``reducer/3``, registered at the end of this module).
CURRENT = "reducer/3"

#: Explicit migrations: old version -> (target version, function mapping the old ``(type, payload)``
#: event list to the target version's events). Empty while only ``reducer/1`` exists.
MIGRATIONS: dict[str, tuple[str, Callable[[list[tuple[str, dict]]], list[tuple[str, dict]]]]] = {}


class UnknownReducer(Exception):
    """The task is pinned to a reducer version this build neither carries nor can migrate."""


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


def _register_v2() -> None:
    from apps.tasks import reducer_v2, reducer_v3

    REDUCERS[reducer_v2.VERSION] = reducer_v2.reduce
    REDUCERS[reducer_v3.VERSION] = reducer_v3.reduce


#: versions with ``reducer/2``'s plan (comments, conflicts, compensation) — ``reducer/3`` adds the ledger
V2_PLAN = ("reducer/2", "reducer/3")


_register_v2()
