"""δ version ``reducer/2``: writes on an existing ticket, conflicts and compensation (DESIGN.md §4, §6; spec §16.4
"补偿事务", table 16.5 "取消后收到回执").

``reducer/2`` is ``reducer/1`` (:mod:`apps.tasks.reducer`) plus:

* ``ticket.read`` (in ``RETRIEVING``, before ``device.read``): the device's open ticket, read from its
  ticket system with its current version, or None. The plan may then be a ``ticket.comment`` on
  that ticket instead of a second ticket. Every re-plan clears it, so it is read again.
* ``dispatch.conflict``: the ticket system answered 412 to a conditional write (the ticket moved
  on since the plan read it). The action was not executed; its reservation is released, its
  approval invalidated and the task re-plans from ``RETRIEVING`` (re-read, re-draft, re-approve).
* Compensation, a saga step: a task that was cancelled although its ticket was created (a late
  receipt, or a receipt followed by the cancel) may close that ticket. The compensation is a new
  action with its own approval, tracked in ``state["compensation"]``:

  ``compensation.requested`` (``CANCELLED`` → ``COMPENSATING``) → ``approval.granted`` →
  ``intent.committed`` → ``receipt.recorded`` (→ back to ``CANCELLED``, compensated).
  A rejected compensation goes back to ``CANCELLED`` with the ticket left open. A conflict or an
  invalidated approval re-plans it (``REPLANNING``). A compensation that fails — a definite
  failure, too many conflicts, a ticket system that cannot write conditionally — waits in its
  own state ``WAITING_COMPENSATION`` until a person retries it (``compensation.retry``) or records
  that it was done by hand or is not needed (``compensation.resolved``).

Events shared with ``reducer/1`` (``approval.*``, ``intent.committed``, ``receipt.recorded``,
``outcome.unknown``, ``reconciliation.retry``, ``dispatch.failed``) apply to the compensation
when the task is in ``COMPENSATING`` and the event names the compensation's approval or action.

The state gains ``ticket``, ``conflicts`` and ``compensation`` (set by ``task.accepted``).
"""

from __future__ import annotations

from apps.tasks.reducer import core
from apps.tasks.reducer import v1 as r1
from apps.tasks.reducer.core import (
    CANCELLED,
    COMPENSATING,
    DISPATCHING,
    RETRIEVING,
    WAITING_APPROVAL,
    WAITING_COMPENSATION,
    WAITING_RECONCILIATION,
    require,
)

VERSION = "reducer/2"

#: compensation sub-statuses
C_WAITING_APPROVAL = "WAITING_APPROVAL"
C_DISPATCHING = "DISPATCHING"
C_REPLANNING = "REPLANNING"
C_DONE = "DONE"
C_REJECTED = "REJECTED"
C_FAILED = "FAILED"
C_RESOLVED = "RESOLVED"


def _accepted(s: dict, p: dict) -> None:
    r1._accepted(s, p)
    s["ticket"] = None
    s["conflicts"] = 0
    s["compensation"] = None


def _ticket_read(s: dict, p: dict) -> None:
    require(s["device"] is None, s, "ticket.read", "the ticket must be read before the device read")
    s["ticket"] = p["ticket"]


def _forget_ticket(handler):
    def apply(s: dict, p: dict) -> None:
        handler(s, p)
        s["ticket"] = None  # re-plan from fresh premises: the ticket is read again
    return apply


def _comp(s: dict) -> dict | None:
    return s.get("compensation")


def _is_comp_approval(s: dict, p: dict) -> bool:
    c = _comp(s)
    return s["status"] == COMPENSATING and c is not None and c.get("approval") is not None \
        and c["approval"]["id"] == p.get("approval_id")


def _is_comp_action(s: dict, p: dict) -> bool:
    c = _comp(s)
    return c is not None and c.get("action") is not None and c["action"]["id"] == p.get("action_id")


def _release(s: dict, action: dict) -> None:
    b = s["budget"]
    s["budget"] = {**b, "reserved": b["reserved"] - int(action["reservation"])}


def _after_compensation(s: dict, note: str) -> None:
    c = s["compensation"]
    s["status"] = c["after"]
    base = (s.get("termination_reason") or "").split("; compensation")[0]
    s["termination_reason"] = f"{base}; compensation {note}"


# --- approvals ---------------------------------------------------------------------------------

CONFLICT_REASON = "the ticket changed since the approval"


def _approval_requested(s: dict, p: dict) -> None:
    previous = s.get("approval")
    r1._approval_requested(s, p)
    if p.get("carried_over_from"):
        # The same low-risk write approved before in this task (only the ticket version moved):
        # granted by that approval, not asked again (DESIGN.md §7).
        require(previous is not None and previous["id"] == p["carried_over_from"]
                 and previous.get("reason") == CONFLICT_REASON, s, "approval.requested",
                 "only the approval a conflict invalidated can be carried over")
        s["approval"] = {**s["approval"], "status": "APPROVED", "decided_by": p["decided_by"],
                         "carried_over_from": p["carried_over_from"]}


def _approval_granted(s: dict, p: dict) -> None:
    if not _is_comp_approval(s, p):
        require(s["status"] == WAITING_APPROVAL, s, "approval.granted", "not the pending approval")
        return r1._approval_granted(s, p)
    c = s["compensation"]
    require(c["approval"]["status"] == "PENDING", s, "approval.granted", f"approval is {c['approval']['status']}")
    s["compensation"] = {**c, "approval": {**c["approval"], "status": "APPROVED", "decided_by": p["decided_by"]}}


def _approval_rejected(s: dict, p: dict) -> None:
    if not _is_comp_approval(s, p):
        require(s["status"] == WAITING_APPROVAL, s, "approval.rejected", "not the pending approval")
        return r1._approval_rejected(s, p)
    c = s["compensation"]
    require(c["approval"]["status"] == "PENDING", s, "approval.rejected", f"approval is {c['approval']['status']}")
    s["compensation"] = {**c, "status": C_REJECTED,
                         "approval": {**c["approval"], "status": "REJECTED", "decided_by": p["decided_by"],
                                      "reason": p.get("reason", "")}}
    _after_compensation(s, f"rejected by {p['decided_by']}: ticket {c['ticket']['external_id']} left as it is")


def _approval_invalidated(s: dict, p: dict) -> None:
    if not _is_comp_approval(s, p):
        require(s["status"] in (WAITING_APPROVAL, DISPATCHING), s, "approval.invalidated", "not the current approval")
        r1._approval_invalidated(s, p)
        s["ticket"] = None
        return
    c = s["compensation"]
    require(c["action"] is None or c["action"]["status"] == "INTENDED", s, "approval.invalidated",
             "the compensation was already sent")
    if c["action"] is not None:
        require(p.get("action_not_sent") is True, s, "approval.invalidated", "a compensation was committed")
        _release(s, c["action"])
    s["compensation"] = {**c, "status": C_REPLANNING, "action": None, "replans": c["replans"] + 1,
                         "approval": {**c["approval"], "status": "INVALIDATED", "reason": p["reason"]}}


# --- the compensation's action -------------------------------------------------------------------

def _intent_committed(s: dict, p: dict) -> None:
    if s["status"] != COMPENSATING:
        return r1._intent_committed(s, p)
    c = s["compensation"]
    require(c["status"] == C_WAITING_APPROVAL and c["action"] is None, s, "intent.committed",
             f"the compensation is {c['status']}")
    require(c.get("approval") is not None and c["approval"]["status"] == "APPROVED", s, "intent.committed",
             "compensation approval not granted")
    require(c["approval"]["digest"] == p["digest"], s, "intent.committed", "digest differs from the approved one")
    rsv = int(p["reservation"])
    b = s["budget"]
    refusal = core.admission_refusal(b, rsv)
    require(refusal is None, s, "intent.committed", refusal or "")
    s["budget"] = {**b, "reserved": b["reserved"] + rsv}
    s["compensation"] = {**c, "status": C_DISPATCHING, "action": {
        "id": p["action_id"], "idempotency_key": p["idempotency_key"], "digest": p["digest"],
        "reservation": rsv, "status": "INTENDED"}}


def _receipt_recorded(s: dict, p: dict) -> None:
    if not _is_comp_action(s, p):
        require(s["status"] in (DISPATCHING, WAITING_RECONCILIATION, CANCELLED), s, "receipt.recorded",
                 f"not legal in {s['status']}")
        return r1._receipt_recorded(s, p)
    c = s["compensation"]
    require(c["action"]["status"] in ("INTENDED", "UNKNOWN"), s, "receipt.recorded",
             f"the compensation is {c['action']['status']}")
    cost, rsv = int(p["cost"]), int(c["action"]["reservation"])
    require(0 <= cost <= rsv, s, "receipt.recorded", f"cost {cost} outside [0, reservation {rsv}]")
    b = s["budget"]
    s["budget"] = {**b, "used": b["used"] + cost, "reserved": b["reserved"] - rsv}
    s["compensation"] = {**c, "status": C_DONE, "receipt": p["receipt"],
                         "action": {**c["action"], "status": "SUCCEEDED", "reservation": 0}}
    _after_compensation(s, f"done: ticket {c['ticket']['external_id']} {p['receipt'].get('status') or 'updated'}")


def _outcome_unknown(s: dict, p: dict) -> None:
    if not _is_comp_action(s, p):
        require(s["status"] in (DISPATCHING, CANCELLED), s, "outcome.unknown", f"not legal in {s['status']}")
        return r1._outcome_unknown(s, p)
    c = s["compensation"]
    require(c["action"]["status"] == "INTENDED", s, "outcome.unknown", f"the compensation is {c['action']['status']}")
    s["compensation"] = {**c, "action": {**c["action"], "status": "UNKNOWN"}}


def _reconciliation_retry(s: dict, p: dict) -> None:
    if not _is_comp_action(s, p):
        require(s["status"] == WAITING_RECONCILIATION, s, "reconciliation.retry", f"not legal in {s['status']}")
        return r1._reconciliation_retry(s, p)
    c = s["compensation"]
    require(c["action"]["status"] == "UNKNOWN", s, "reconciliation.retry", "the compensation is not unknown")
    s["compensation"] = {**c, "action": {**c["action"], "status": "INTENDED"}}


def _dispatch_failed(s: dict, p: dict) -> None:
    if not _is_comp_action(s, p):
        require(s["status"] in (DISPATCHING, WAITING_RECONCILIATION, CANCELLED), s, "dispatch.failed",
                 f"not legal in {s['status']}")
        return r1._dispatch_failed(s, p)
    c = s["compensation"]
    require(c["action"]["status"] in ("INTENDED", "UNKNOWN"), s, "dispatch.failed",
             f"the compensation is {c['action']['status']}")
    _release(s, c["action"])
    s["compensation"] = {**c, "status": C_FAILED, "error": p["error"],
                         "action": {**c["action"], "status": "FAILED", "reservation": 0, "error": p["error"]}}
    s["status"] = WAITING_COMPENSATION


def _dispatch_conflict(s: dict, p: dict) -> None:
    """A 412: the write was not executed because the ticket moved on (``expected_version`` →
    ``current_version``). Re-read and re-plan; in ``CANCELLED`` the action just ends unsent."""
    conflict = {"action_id": p["action_id"], "expected_version": p["expected_version"],
                "current_version": p.get("current_version")}
    if _is_comp_action(s, p):
        c = s["compensation"]
        require(c["action"]["status"] == "INTENDED", s, "dispatch.conflict",
                 f"the compensation is {c['action']['status']}")
        _release(s, c["action"])
        s["compensation"] = {**c, "status": C_REPLANNING, "action": None, "conflicts": c["conflicts"] + 1,
                             "last_conflict": conflict,
                             "approval": {**c["approval"], "status": "INVALIDATED", "reason": CONFLICT_REASON}}
        return
    a = s["action"]
    require(a is not None and a["id"] == p["action_id"], s, "dispatch.conflict", "conflict for an unknown action")
    require(a["status"] == "INTENDED", s, "dispatch.conflict", f"the action is {a['status']}")
    require(s["status"] in (DISPATCHING, CANCELLED), s, "dispatch.conflict", f"not legal in {s['status']}")
    _release(s, a)
    if s["status"] == CANCELLED:
        s["action"] = {**a, "status": "FAILED", "reservation": 0, "error": "version_mismatch"}
        return
    s["action"] = None
    s["conflicts"] += 1
    s["replans"] += 1
    s["last_conflict"] = conflict
    if s["approval"] is not None and s["approval"]["status"] == "APPROVED":
        s["approval"] = {**s["approval"], "status": "INVALIDATED", "reason": CONFLICT_REASON}
    for key in ("proposal", "draft", "evidence", "device", "ticket"):
        s[key] = None
    s["status"] = RETRIEVING


# --- compensation lifecycle --------------------------------------------------------------------

def _compensation_requested(s: dict, p: dict) -> None:
    c = _comp(s)
    if s["status"] == CANCELLED:
        receipt = s["receipt"]
        require(receipt is not None and receipt.get("kind", "ticket") == "ticket", s, "compensation.requested",
                 "only a ticket this task created can be compensated")
        require(c is None, s, "compensation.requested", "a compensation was already requested")
        c = {"after": CANCELLED, "reason": p["reason"], "conflicts": 0, "replans": 0, "action": None,
             "history": []}
    else:
        require(c is not None and c["status"] == C_REPLANNING, s, "compensation.requested",
                 "the compensation is not re-planning")
    require(p["ticket"]["external_id"] == s["receipt"]["external_id"], s, "compensation.requested",
             "a compensation closes the ticket this task created, no other")
    history = [*c["history"], c["approval"]] if c.get("approval") else c["history"]
    c = {**c, "ticket": p["ticket"], "history": history, "approval": None, "proposal": None,
         "started_at": c.get("started_at") or p.get("requested_at")}
    outcome = p.get("outcome")
    if outcome == "not_needed":
        # Decided at once, in this one event: e.g. the ticket also carries other requests' reports.
        s["compensation"] = {**c, "status": C_RESOLVED,
                             "resolution": {"outcome": outcome, "by": p.get("by"), "note": p["note"]}}
        _after_compensation(s, f"not needed ({p['note']})")
        return
    if outcome == "needs_person":
        # Cannot be done by faultdesk (e.g. no conditional update): a person decides.
        s["compensation"] = {**c, "status": C_FAILED, "error": p["note"]}
        s["status"] = WAITING_COMPENSATION
        return
    require(outcome is None, s, "compensation.requested", f"unknown outcome {outcome!r}")
    require(bool(p.get("proposal")) and bool(p.get("approval_id")), s, "compensation.requested",
             "a compensation needs its proposal and its own approval")
    approval = {"id": p["approval_id"], "status": "PENDING", "digest": p["proposal"]["digest"],
                "object_version": p["ticket"]["version"], "policy_version": p["policy_version"],
                "expires_at": p["expires_at"]}
    s["compensation"] = {**c, "status": C_WAITING_APPROVAL, "proposal": p["proposal"], "approval": approval}
    s["status"] = COMPENSATING


def _compensation_failed(s: dict, p: dict) -> None:
    c = s["compensation"]
    require(c["action"] is None or c["action"]["status"] in ("FAILED", "SUCCEEDED"), s, "compensation.failed",
             "the compensation action is in flight or unknown: reconcile it first")
    s["compensation"] = {**c, "status": C_FAILED, "error": p["reason"]}
    s["status"] = WAITING_COMPENSATION


def _compensation_retry(s: dict, p: dict) -> None:
    c = s["compensation"]
    history = [*c["history"], c["approval"]] if c.get("approval") else c["history"]
    s["compensation"] = {**c, "status": C_REPLANNING, "action": None, "approval": None, "conflicts": 0,
                         "replans": 0, "history": history, "retried_by": p["by"]}
    s["status"] = COMPENSATING


def _compensation_resolved(s: dict, p: dict) -> None:
    c = s["compensation"]
    require(s["status"] == WAITING_COMPENSATION or c["status"] == C_REPLANNING, s, "compensation.resolved",
             "only a failed or re-planning compensation can be resolved without its action")
    require(p["outcome"] in ("done_by_hand", "not_needed"), s, "compensation.resolved", "unknown outcome")
    s["compensation"] = {**c, "status": C_RESOLVED, "resolution": {k: p.get(k) for k in ("outcome", "by", "note")}}
    words = {"done_by_hand": "done by hand", "not_needed": "not needed"}[p["outcome"]]
    _after_compensation(s, f"{words} ({p.get('note') or p['by']})")


_T1 = r1.TRANSITIONS

#: The state table of ``reducer/2``: event type -> (statuses in which it is legal, handler).
TRANSITIONS = {
    **_T1,
    "task.accepted": (_T1["task.accepted"][0], _accepted),
    "ticket.read": (frozenset({RETRIEVING}), _ticket_read),
    "input.provided": (_T1["input.provided"][0], _forget_ticket(r1._input_provided)),
    "approval.requested": (_T1["approval.requested"][0], _approval_requested),
    "approval.granted": (_T1["approval.granted"][0] | {COMPENSATING}, _approval_granted),
    "approval.rejected": (_T1["approval.rejected"][0] | {COMPENSATING}, _approval_rejected),
    "approval.invalidated": (_T1["approval.invalidated"][0] | {COMPENSATING}, _approval_invalidated),
    "intent.committed": (_T1["intent.committed"][0] | {COMPENSATING}, _intent_committed),
    "receipt.recorded": (_T1["receipt.recorded"][0] | {COMPENSATING}, _receipt_recorded),
    "outcome.unknown": (_T1["outcome.unknown"][0] | {COMPENSATING}, _outcome_unknown),
    "reconciliation.retry": (_T1["reconciliation.retry"][0] | {COMPENSATING}, _reconciliation_retry),
    "dispatch.failed": (_T1["dispatch.failed"][0] | {COMPENSATING}, _dispatch_failed),
    "dispatch.conflict": (frozenset({DISPATCHING, CANCELLED, COMPENSATING}), _dispatch_conflict),
    "compensation.requested": (frozenset({CANCELLED, COMPENSATING}), _compensation_requested),
    "compensation.failed": (frozenset({COMPENSATING}), _compensation_failed),
    "compensation.retry": (frozenset({WAITING_COMPENSATION}), _compensation_retry),
    "compensation.resolved": (frozenset({COMPENSATING, WAITING_COMPENSATION}), _compensation_resolved),
    # task.failed and cancel.requested keep reducer/1's statuses, which do not include COMPENSATING
    # or WAITING_COMPENSATION: the task was already cancelled, the compensation ends by its own events.
}
EVENT_TYPES = tuple(TRANSITIONS)


def reduce(state: dict, event_type: str, payload: dict) -> dict:
    """δ of ``reducer/2``: the next state for ``event_type`` with ``payload``. Never mutates
    ``state``. Raises :class:`~apps.tasks.reducer.core.IllegalTransition` as ``reducer/1`` does, and
    for the guards of the events above."""
    return core.reduce_with(TRANSITIONS, state, event_type, payload)
