"""``reducer/1``, the first version of δ: ``S_k = δ(S_{k-1}, e_k)`` (DESIGN.md §4; spec §16.3).

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

from apps.tasks.reducer.core import (
    ACCEPTED,
    CANCELLED,
    COMPLETED,
    DISPATCHING,
    FAILED,
    NON_TERMINAL,
    PROPOSING,
    RETRIEVING,
    VALIDATING,
    WAITING_APPROVAL,
    WAITING_INPUT,
    WAITING_RECONCILIATION,
    Handler,
    IllegalTransition,
    admission_refusal,
    reduce_with,
    require,
)

VERSION = "reducer/1"

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


# --- handlers: (state copy, payload) -> None, mutate the copy ---------------------------------

def _accepted(s: dict, p: dict) -> None:
    s["status"] = ACCEPTED
    s["request"] = p["request"]
    s["budget"] = {"total": int(p["budget_total"]), "used": 0, "reserved": 0}


def _retrieval_started(s: dict, p: dict) -> None:
    s["status"] = RETRIEVING


def _evidence_retrieved(s: dict, p: dict) -> None:
    require(s["evidence"] is None, s, "evidence.retrieved", "evidence already recorded for this plan")
    s["evidence"] = p["refs"]
    if "selection" in p:
        # What the relevance check decided (answered / no_procedure, why, the withheld count); an
        # event without it (recorded before the check existed) leaves the state as it was.
        s["selection"] = p["selection"]


def _device_read(s: dict, p: dict) -> None:
    require(s["evidence"] is not None, s, "device.read", "retrieval must be recorded before the device read")
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
    require(digest not in s["rejected_digests"], s, "approval.requested",
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
    require(a is not None and a["id"] == p["approval_id"], s, "approval.granted", "not the pending approval")
    require(a["status"] == "PENDING", s, "approval.granted", f"approval is {a['status']}")
    s["approval"] = {**a, "status": "APPROVED", "decided_by": p["decided_by"]}


def _approval_rejected(s: dict, p: dict) -> None:
    a = s["approval"]
    require(a is not None and a["id"] == p["approval_id"], s, "approval.rejected", "not the pending approval")
    require(a["status"] == "PENDING", s, "approval.rejected", f"approval is {a['status']}")
    s["approval"] = {**a, "status": "REJECTED", "decided_by": p["decided_by"], "reason": p.get("reason", "")}
    s["rejected_digests"] = [*s["rejected_digests"], a["digest"]]
    s["proposal"] = None
    s["draft"] = None
    s["status"] = PROPOSING


def _approval_invalidated(s: dict, p: dict) -> None:
    a = s["approval"]
    require(a is not None and a["id"] == p["approval_id"], s, "approval.invalidated", "not the current approval")
    require(s["action"] is None or s["status"] == DISPATCHING, s, "approval.invalidated", "action already sent")
    if s["status"] == DISPATCHING:
        require(p.get("action_not_sent") is True, s, "approval.invalidated", "an action was committed")
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
    require(s["action"] is None, s, "intent.committed", "an action is already committed")
    if s["status"] == WAITING_APPROVAL:
        a = s["approval"]
        require(a is not None and a["status"] == "APPROVED", s, "intent.committed", "approval not granted")
        require(a["digest"] == p["digest"], s, "intent.committed", "digest differs from the approved one")
    else:
        require(p.get("approval_required") is False, s, "intent.committed", "this action needs an approval")
        require(p["digest"] not in s["rejected_digests"], s, "intent.committed", "action was rejected earlier")
    r = int(p["reservation"])
    b = s["budget"]
    refusal = admission_refusal(b, r)
    require(refusal is None, s, "intent.committed", refusal or "")
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
    require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "receipt.recorded",
             "receipt for an action this task did not commit")
    require(s["receipt"] is None, s, "receipt.recorded", "receipt already recorded")
    _settle(s, int(p["cost"]))
    s["receipt"] = p["receipt"]
    s["action"] = {**s["action"], "status": "SUCCEEDED"}
    if s["status"] == WAITING_RECONCILIATION:
        s["status"] = DISPATCHING
    # In CANCELLED the status stays: cancel stops the future, it does not undo the past.


def _outcome_unknown(s: dict, p: dict) -> None:
    require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "outcome.unknown", "unknown action")
    require(s["receipt"] is None, s, "outcome.unknown", "the receipt is already recorded (a stale dispatcher)")
    s["action"] = {**s["action"], "status": "UNKNOWN"}
    if s["status"] == DISPATCHING:
        s["status"] = WAITING_RECONCILIATION


def _reconciliation_retry(s: dict, p: dict) -> None:
    require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "reconciliation.retry",
             "unknown action")
    s["action"] = {**s["action"], "status": "INTENDED"}
    s["status"] = DISPATCHING


def _dispatch_failed(s: dict, p: dict) -> None:
    require(s["action"] is not None and s["action"]["id"] == p["action_id"], s, "dispatch.failed", "unknown action")
    b = s["budget"]
    s["budget"] = {**b, "reserved": b["reserved"] - int(s["action"]["reservation"])}
    s["action"] = {**s["action"], "status": "FAILED", "reservation": 0, "error": p["error"]}
    if s["status"] != CANCELLED:
        s["status"] = FAILED
        s["termination_reason"] = f"dispatch_failed: {p['error']}"


def _task_completed(s: dict, p: dict) -> None:
    reason = p["reason"]
    if s["status"] == DISPATCHING:
        require(s["receipt"] is not None, s, "task.completed", "no receipt: a task never shows created without one")
    else:
        require(s["action"] is None, s, "task.completed", "an action is in flight")
        require(reason in ("proposal_rejected", "no_action_needed"), s, "task.completed",
                 f"reason {reason!r} needs a receipt")
    s["answer"] = p["answer"]
    s["termination_reason"] = reason
    s["status"] = COMPLETED


def _task_failed(s: dict, p: dict) -> None:
    require(s["action"] is None or s["action"]["status"] in ("FAILED", "SUCCEEDED"), s, "task.failed",
             "an action is in flight or unknown: reconcile it first")
    s["termination_reason"] = p["reason"]
    s["status"] = FAILED


def _cancel_requested(s: dict, p: dict) -> None:
    s["cancel_requested"] = True
    s["termination_reason"] = f"cancelled: {p.get('reason') or 'by request'}"
    s["status"] = CANCELLED
    # A committed action keeps its reservation until its outcome is recorded (sent or not).



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


def replay(events: list[tuple[str, dict]], *, start: dict | None = None) -> dict:
    """Fold δ over ``events`` (``(type, payload)`` pairs in seq order) from ``start`` (default
    :func:`initial_state`). Raises :class:`IllegalTransition` on the first illegal event."""
    state = copy.deepcopy(start) if start is not None else initial_state()
    for event_type, payload in events:
        state = reduce(state, event_type, payload)
    return state


