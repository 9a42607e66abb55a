"""δ version ``reducer/6``: plan versions with premises, read activities joined by premise
(long-task-runtime.md: PlanVersion, Replan Barrier; spec §16.3, §16.5; docs/adr/0022).

``reducer/6`` is ``reducer/5`` (:mod:`apps.tasks.reducer.v5`) plus:

* **PlanVersion**, a recorded, immutable object of the task. ``plan.activated`` appends one to
  ``state["plans"]``: ``{"version": n, "premises": {...}, "steps": [...], "reason": str,
  "barrier": {...} | None}``. Nothing ever changes an appended version; a re-plan appends the next
  one. Its premises (:data:`PREMISES`) are what the plan was based on when it was activated: the
  report's material, the requester's scopes and role, the device's object version and the fields
  retrieval filters on, the policy version, the artifact bundle, the approver's role, the open
  ticket's epoch (``state["ticket_epoch"]``: how many times the task learned that the device's open
  ticket moved on — a conflict — or was being created by another report — a deferred intent), and
  the evidence chunk versions it carries. Its ``ticket_epoch`` must be the task's own.
* **Replan Barrier.** Every version after the first is activated behind a barrier recorded in the
  same event: ``{"from_version", "why", "changed": [premise, ...], "continuing": {step: "joined" |
  "in_flight"}, "cancelled": [step, ...]}``. ``changed`` is recomputed here from the previous version's
  premises and the new one's (:func:`changed_premises`) and must agree. A step *continues* when its
  result (joined, or still in flight) depends on no premise that changed (:data:`DEPENDS`,
  :func:`decisive`); every other step of the old version is cancelled and, for a read, done again under
  the new version.
* **Read activities.** The context reads — ``device``, ``ticket``, ``retrieval`` — run as activities
  in parallel under one plan version. Each is admitted by its own ``budget.reserved`` (with ``step``
  and ``plan_version``; the reservation id is the activity's identity) and reports by its read event
  (``device.read``, ``ticket.read``, ``evidence.retrieved``) carrying ``activity_id``,
  ``plan_version``, the ``premises`` it worked under — every key; those it does not observe itself
  (:data:`OBSERVES`) as recorded when it was dispatched (``activities[id]["premises"]``) — the
  ``verdict`` and the calls it ``used`` (which settle its reservation), or by ``result.refused`` /
  ``read.failed``. A read whose report finds nothing waiting for it is settled by ``budget.settled``
  with ``unjoined``, which closes its activity (:data:`UNJOINED`). The task moves to
  ``PROPOSING`` when every read of the current version is joined.
* **Late results by premise, never by arrival order** (:func:`verdict`): a result of an older plan
  version is *accepted* when the premises it depends on equal the current version's and no other
  premise changed; *re-validated* when only premises it does not depend on changed (the result is
  checked against the world now — ``payload["revalidation"]["ok"]`` — before it joins); *refused*
  (``result.refused``, with the changed premises as the reason) when one it depends on changed, and
  the step is done again.
* **Resume re-checks premises.** A task waiting for its approval whose evidence was superseded or
  retired, or one of whose plan's other premises moved (the runtime re-checks each), is re-planned
  from ``WAITING_APPROVAL`` (``plan.activated`` with the approval held in ``state["revalidating"]``):
  the new draft either proposes the same action (``approval.revalidated``: the held approval stands)
  or a different one (``approval.requested`` closes the held approval and asks again);
  ``input.requested`` and ``task.completed`` close it too (:data:`CLOSES_HELD`).

The re-plans of earlier versions (``input.provided``, ``approval.invalidated``, ``dispatch.conflict``,
``intent.deferred``) keep their effect and leave ``state["replan_due"]``; the joined reads they clear
are kept in ``state["carried"]`` so the next version's barrier may carry the ones whose premises still
hold instead of reading them again.
"""

from __future__ import annotations

from apps.tasks.reducer import v3 as r3
from apps.tasks.reducer import v5 as r5
from apps.tasks.reducer.core import (
    CANCELLED,
    FAILED,
    NON_TERMINAL,
    PROPOSING,
    RETRIEVING,
    VALIDATING,
    WAITING_APPROVAL,
    require,
)
from apps.tasks.reducer.premises import (  # noqa: F401 - the rules are reducer/6's, named from it too
    ACCEPTED_,
    DEPENDS,
    OBSERVES,
    PREMISES,
    READ_EVENT,
    READS,
    REFUSED,
    REVALIDATED,
    STEP_OF_EVENT,
    STEPS,
    changed_premises,
    current_plan,
    decisive,
    evidence_moved,
    verdict,
)

VERSION = "reducer/6"
#: what the state keeps of each joined read
_RESULT_KEYS = {"device": ("device",), "ticket": ("ticket",), "retrieval": ("evidence", "selection")}


# --- task.accepted -------------------------------------------------------------------------------

def _accepted(s: dict, p: dict) -> None:
    r5.TRANSITIONS["task.accepted"][1](s, p)
    s["plans"] = []
    s["steps"] = {}
    s["activities"] = {}
    s["carried"] = {}
    s["replan_due"] = None
    s["revalidating"] = None
    s["ticket_epoch"] = 0


# --- plan versions and the barrier ---------------------------------------------------------------

def _plan_activated(s: dict, p: dict) -> None:
    plans = s["plans"]
    version = p.get("version")
    require(version == len(plans) + 1, s, "plan.activated", f"the next plan version is {len(plans) + 1}")
    premises = p.get("premises")
    require(isinstance(premises, dict) and set(premises) == set(PREMISES), s, "plan.activated",
            f"a plan version records every premise: {', '.join(PREMISES)}")
    require(premises["ticket_epoch"] == s.get("ticket_epoch", 0), s, "plan.activated",
            f"the ticket_epoch premise is the task's own ({s.get('ticket_epoch', 0)})")
    steps = list(p.get("steps") or [])
    require(set(READS) <= set(steps) <= set(STEPS), s, "plan.activated", "a plan has the reads and known steps")
    barrier = p.get("barrier")
    if plans:
        require(isinstance(barrier, dict) and barrier.get("from_version") == len(plans) and barrier.get("why"),
                s, "plan.activated", "a re-plan is recorded behind a barrier (from_version, why)")
        changed = changed_premises(plans[-1]["premises"], premises)
        require(barrier.get("changed") == changed, s, "plan.activated",
                f"the barrier's changed premises are those that differ from version {len(plans)}'s: "
                f"{', '.join(changed) or 'none'}")
        continuing = barrier.get("continuing") or {}
        require(set(continuing) <= set(READS), s, "plan.activated", "only reads continue across a barrier")
        for step, how in continuing.items():
            _require_continues(s, step, how, premises)
        require(set(barrier.get("cancelled") or []) == set(STEPS) - set(continuing), s, "plan.activated",
                "the barrier cancels every step that does not continue")
    else:
        require(barrier is None, s, "plan.activated", "the first plan version has no barrier")
        continuing = {}
    if s["status"] == WAITING_APPROVAL:
        a = s.get("approval")
        require(a is not None and a["status"] in ("PENDING", "APPROVED"), s, "plan.activated",
                "a waiting task re-plans here only to re-validate its live approval")
        s["revalidating"] = {"approval_id": a["id"], "digest": a["digest"], "why": barrier["why"]}
        s["proposal"] = None
        s["draft"] = None
    joined_now = {step: s["steps"].get(step) for step in READS}
    new_steps = {}
    for step in READS:
        how = continuing.get(step)
        old = joined_now.get(step) or {}
        if how == "joined":
            if old.get("status") != "joined":
                carried = s["carried"][step]
                for key in _RESULT_KEYS[step]:
                    s[key] = carried["values"].get(key)
                old = {"status": "joined", "activity_id": carried["activity_id"],
                       "plan_version": carried["plan_version"], "premises": carried["premises"]}
            new_steps[step] = old
        elif how == "in_flight":
            new_steps[step] = old
        else:
            for key in _RESULT_KEYS[step]:
                s[key] = None
            new_steps[step] = {"status": "pending"}
    plans.append({"version": version, "premises": premises, "steps": steps, "reason": p.get("reason", ""),
                  "barrier": barrier})
    s["steps"] = new_steps
    s["carried"] = {}
    s["replan_due"] = None
    s["status"] = RETRIEVING
    _join(s)


def _require_continues(s: dict, step: str, how: str, premises: dict) -> None:
    """The barrier may let ``step`` continue only if its result (joined now, carried from before a
    re-plan, or in flight) depends on no premise that differs in the new version."""
    etype = "plan.activated"
    if how == "in_flight":
        st = s["steps"].get(step) or {}
        require(st.get("status") == "dispatched", s, etype, f"{step} is not in flight")
        act = s["activities"][st["activity_id"]]
        require(verdict(step, act["premises"], premises)[0] != REFUSED, s, etype,
                f"{step} in flight depends on a premise that changed")
        return
    require(how == "joined", s, etype, f"a step continues 'joined' or 'in_flight', not {how!r}")
    st = s["steps"].get(step) or {}
    if st.get("status") == "joined":
        result_premises = st["premises"]
    else:
        require(step in s["carried"], s, etype, f"{step} has no joined result to carry")
        result_premises = s["carried"][step]["premises"]
    v, keys = verdict(step, result_premises, premises)
    require(v != REFUSED, s, etype, f"{step}'s result depends on premises that changed: {', '.join(keys)}")


# --- read activities ----------------------------------------------------------------------------

def _budget_reserved(s: dict, p: dict) -> None:
    r3.TRANSITIONS["budget.reserved"][1](s, p)
    step = p.get("step")
    if step is None:
        return  # an activity that is not a read (a model call)
    plan = current_plan(s)
    require(step in READS and plan is not None and p.get("plan_version") == plan["version"], s,
            "budget.reserved", "a read is dispatched under the current plan version")
    require((s["steps"].get(step) or {}).get("status") == "pending", s, "budget.reserved",
            f"{step} is not waiting to be dispatched")
    rid = p["reservation_id"]
    s["activities"] = {**s["activities"], rid: {"step": step, "plan_version": plan["version"],
                                                "premises": plan["premises"], "status": "dispatched",
                                                "deadline": p.get("deadline")}}
    s["steps"] = {**s["steps"], step: {"status": "dispatched", "activity_id": rid, "plan_version": plan["version"]}}


def _activity(s: dict, p: dict, etype: str, step: str | None = None) -> dict:
    aid = p.get("activity_id")
    act = s["activities"].get(aid)
    require(act is not None, s, etype, "a read result names an activity this task dispatched")
    # a lapsed activity (charged at its reservation when its deadline passed) may still report: its
    # result is judged by premise like any other
    require(act["status"] in ("dispatched", "lapsed"), s, etype, f"the activity already reported ({act['status']})")
    require(step is None or act["step"] == step, s, etype, f"the activity read {act['step']}, not {step}")
    require(p.get("plan_version") == act["plan_version"], s, etype, "the result names its activity's plan version")
    return act


def _set_activity(s: dict, aid: str, status: str, p: dict, etype: str) -> None:
    """Mark activity ``aid`` with ``status`` and settle its reservation at ``p["used"]`` (the calls
    it made) when the report carries it and the reservation is still open (a lapsed activity's was
    charged at its reservation already)."""
    s["activities"] = {**s["activities"], aid: {**s["activities"][aid], "status": status}}
    if "used" in p:
        require(aid in s["reservations"], s, etype, "no open reservation to settle: a lapsed activity reports "
                                                    "without its cost")
        r3._settle(s, {"reservation_id": aid, "used": p["used"]}, etype)


def _read_result(step: str):
    etype = READ_EVENT[step]

    def apply(s: dict, p: dict) -> None:
        act = _activity(s, p, etype, step)
        premises = p.get("premises")
        _require_dispatch_premises(s, etype, act, premises)
        plan = current_plan(s)
        refs = [r.get("chunk_id") for r in p.get("refs") or []] if step == "retrieval" else None
        expected, changed = verdict(step, premises, plan["premises"], refs)
        require(expected != REFUSED, s, etype,
                f"the premises it depends on changed ({', '.join(changed)}): record result.refused")
        require(p.get("verdict") == expected, s, etype, f"the verdict by premise is {expected!r}")
        if expected == REVALIDATED:
            check = p.get("revalidation") or {}
            require(check.get("ok") is True, s, etype, "a re-validated result carries a passing check")
        st = s["steps"].get(step) or {}
        require(st.get("status") in ("pending", "dispatched"), s, etype, f"{step} is already joined")
        if step == "device":
            s["device"] = p["reading"]
        elif step == "ticket":
            s["ticket"] = p["ticket"]
        else:
            s["evidence"] = p["refs"]
            if "selection" in p:
                s["selection"] = p["selection"]
        _set_activity(s, p["activity_id"], expected, p, etype)
        s["steps"] = {**s["steps"], step: {"status": "joined", "activity_id": p["activity_id"],
                                           "plan_version": act["plan_version"], "premises": premises}}
        _join(s)

    return apply


def _require_dispatch_premises(s: dict, etype: str, act: dict, premises) -> None:
    """A read's report records every premise, and each one the read does not observe itself
    (:data:`OBSERVES`) as it was when the read was dispatched (``act["premises"]``): a result is
    judged by what it was computed under, never by what it claims."""
    require(isinstance(premises, dict) and set(premises) == set(PREMISES), s, etype,
            f"a read result records every premise it was computed under: {', '.join(PREMISES)}")
    claimed = [k for k in PREMISES if k not in OBSERVES[act["step"]] and premises[k] != act["premises"].get(k)]
    require(not claimed, s, etype, f"the result claims premises it was not dispatched under: {', '.join(claimed)}")


def _join(s: dict) -> None:
    """Move on to the draft once every read of the current plan is joined (in ``RETRIEVING``)."""
    if s["status"] == RETRIEVING and all((s["steps"].get(r) or {}).get("status") == "joined" for r in READS):
        s["status"] = PROPOSING
        if s.get("coalesce") is not None:
            s["coalesce"] = None  # the plan's reads were taken again: the wait is over (reducer/4)


def _result_refused(s: dict, p: dict) -> None:
    act = _activity(s, p, "result.refused")
    require(bool(p.get("reason")), s, "result.refused", "a refusal records its reason")
    premises = p.get("premises")
    if premises is not None or p.get("revalidation") is None:
        _require_dispatch_premises(s, "result.refused", act, premises)
    if p.get("revalidation") is None:
        plan = current_plan(s)
        require(isinstance(premises, dict) and verdict(act["step"], premises, plan["premises"])[0] == REFUSED,
                s, "result.refused", "only a result whose decisive premises changed, or that failed its "
                                     "re-validation, is refused")
    else:
        require(p["revalidation"].get("ok") is False, s, "result.refused", "the re-validation passed")
    _set_activity(s, p["activity_id"], "refused", p, "result.refused")
    _redo_if_current(s, act["step"], p["activity_id"])


def _read_failed(s: dict, p: dict) -> None:
    act = _activity(s, p, "read.failed")
    require(bool(p.get("error")), s, "read.failed", "a failed read records its error")
    _set_activity(s, p["activity_id"], "failed", p, "read.failed")
    _redo_if_current(s, act["step"], p["activity_id"])


def _redo_if_current(s: dict, step: str, aid: str) -> None:
    """The step waits for a new dispatch when ``aid`` was its current activity."""
    st = s["steps"].get(step) or {}
    if st.get("status") == "dispatched" and st.get("activity_id") == aid:
        s["steps"] = {**s["steps"], step: {"status": "pending"}}


#: the status of a read whose report found nothing waiting for it (or that never ran: its task
#: ended): its cost settled (``budget.settled`` with ``unjoined``), never joined, closed
UNJOINED = "unjoined"


def _budget_settled(s: dict, p: dict) -> None:
    rid = p.get("reservation_id")
    dispatched = rid in s["activities"] and s["activities"][rid]["status"] == "dispatched"
    lapsed = dispatched and p.get("unknown_outcome")
    if p.get("unjoined"):
        require(dispatched and not p.get("unknown_outcome"), s, "budget.settled",
                "only a read still dispatched is settled unjoined, at what it used")
    r3.TRANSITIONS["budget.settled"][1](s, p)
    if lapsed:
        # an activity that never reported by its deadline: charged at its reservation, done again
        s["activities"] = {**s["activities"], rid: {**s["activities"][rid], "status": "lapsed"}}
        _redo_if_current(s, s["activities"][rid]["step"], rid)
    elif p.get("unjoined"):
        # its report found nothing to join — the task moved on, or another read of its step joined
        # first — or it never ran (its task ended): closed, so it neither reads nor joins again
        s["activities"] = {**s["activities"], rid: {**s["activities"][rid], "status": UNJOINED}}


# --- re-plans keep what they clear, for the next version's barrier ---------------------------------

def _replanning(etype: str):
    base = r5.TRANSITIONS[etype][1]

    def apply(s: dict, p: dict) -> None:
        carried = {}
        for step in READS:
            st = s["steps"].get(step) or {}
            if st.get("status") == "joined":
                carried[step] = {"activity_id": st["activity_id"], "plan_version": st["plan_version"],
                                 "premises": st["premises"], "values": {k: s.get(k) for k in _RESULT_KEYS[step]}}
        before = s["status"]
        base(s, p)
        if etype in ("dispatch.conflict", "intent.deferred"):
            s["ticket_epoch"] = s.get("ticket_epoch", 0) + 1  # the open ticket moved on, or is being made
        if s["status"] == RETRIEVING and before != RETRIEVING:
            s["carried"] = carried
            s["steps"] = {}
            s["revalidating"] = None
            s["replan_due"] = {"event": etype, "reason": str(p.get("reason") or p.get("error") or etype)[:300]}

    return apply


# --- the approval held while its evidence is re-validated ----------------------------------------

def _approval_revalidated(s: dict, p: dict) -> None:
    held = s.get("revalidating")
    require(held is not None and held["approval_id"] == p.get("approval_id"), s, "approval.revalidated",
            "no approval is held for re-validation")
    proposal = p.get("proposal") or {}
    require(proposal.get("digest") == held["digest"] == s["approval"]["digest"], s, "approval.revalidated",
            "the new proposal differs from the approved one: ask again")
    require(s["approval"]["status"] in ("PENDING", "APPROVED"), s, "approval.revalidated",
            f"the held approval is {s['approval']['status']}")
    s["proposal"] = proposal
    s["revalidating"] = None
    s["status"] = WAITING_APPROVAL


def held_closed_by(state: dict, event_type: str) -> str | None:
    """The id of the held approval (``state["revalidating"]``) that ``event_type`` — one of
    :data:`CLOSES_HELD` — marks ``INVALIDATED`` when appended to ``state`` now, or None (nothing
    held, the held approval no longer live, or the event does not close it from this status). The
    runtime invalidates that approval's row in the event's transaction (reducer/3: the state shows
    what the approval row says). Pure."""
    held = state.get("revalidating")
    if held is None or event_type not in CLOSES_HELD:
        return None
    if event_type != "approval.requested" and state.get("status") == WAITING_APPROVAL:
        return None
    a = state.get("approval")
    if a is not None and a["id"] == held["approval_id"] and a["status"] in ("PENDING", "APPROVED"):
        return a["id"]
    return None


def _close_held(s: dict, why: str) -> None:
    held = s.get("revalidating")
    if held is None:
        return
    a = s.get("approval")
    if a is not None and a["id"] == held["approval_id"] and a["status"] in ("PENDING", "APPROVED"):
        s["approval"] = {**a, "status": "INVALIDATED", "reason": why}
    s["revalidating"] = None


#: why a held approval is closed when the re-validated draft proposes another action (the barrier's
#: ``why`` — what moved — follows it: :func:`changed_proposal_reason`)
CHANGED_PROPOSAL = "the proposal changed: asked again"


def closing_reason(state: dict, event_type: str) -> str:
    """The reason recorded on the held approval that ``event_type`` (one of :data:`CLOSES_HELD`)
    closes: what moved during the wait (the barrier's ``why``), then what the re-validated draft
    does instead (``CLOSES_HELD[event_type]``). Pure."""
    why = (state.get("revalidating") or {}).get("why")
    return f"{why} — {CLOSES_HELD[event_type]}" if why else CLOSES_HELD[event_type]


def changed_proposal_reason(state: dict) -> str:
    """:func:`closing_reason` of ``approval.requested`` (the draft proposes another action)."""
    return closing_reason(state, "approval.requested")
#: why a held approval is closed when the re-validated draft asks the requester first (``input.requested``)
ASKS_REQUESTER = "the re-validated draft asks the requester first"
#: why a held approval is closed when the re-validated draft needs no action (``task.completed``)
NO_ACTION = "the re-validated draft needs no action"
#: the reason each event that closes a held approval records on it (the runtime invalidates the
#: approval's row with the same reason, in the event's transaction)
CLOSES_HELD = {"approval.requested": CHANGED_PROPOSAL, "input.requested": ASKS_REQUESTER, "task.completed": NO_ACTION}


def _approval_requested(s: dict, p: dict) -> None:
    _close_held(s, changed_proposal_reason(s))
    r5.TRANSITIONS["approval.requested"][1](s, p)


def _closing_held(etype: str):
    base = r5.TRANSITIONS[etype][1]

    def apply(s: dict, p: dict) -> None:
        if s["status"] != WAITING_APPROVAL:
            _close_held(s, closing_reason(s, etype))
        base(s, p)

    return apply


def _intent_committed(s: dict, p: dict) -> None:
    require(s.get("revalidating") is None, s, "intent.committed", "the held approval is being re-validated")
    r5.TRANSITIONS["intent.committed"][1](s, p)


_T5 = r5.TRANSITIONS
#: the reads report while the task can still take them; after a cancel or a failure only their cost
_READ_STATUSES = frozenset({RETRIEVING})

#: The state table of ``reducer/6``: event type -> (statuses in which it is legal, handler).
TRANSITIONS = {
    **_T5,
    "task.accepted": (_T5["task.accepted"][0], _accepted),
    "plan.activated": (frozenset({RETRIEVING, WAITING_APPROVAL}), _plan_activated),
    "budget.reserved": (_T5["budget.reserved"][0], _budget_reserved),
    "budget.settled": (_T5["budget.settled"][0], _budget_settled),
    "device.read": (_READ_STATUSES, _read_result("device")),
    "ticket.read": (_READ_STATUSES, _read_result("ticket")),
    "evidence.retrieved": (_READ_STATUSES, _read_result("retrieval")),
    "result.refused": (frozenset(NON_TERMINAL) | {CANCELLED, FAILED}, _result_refused),
    "read.failed": (frozenset(NON_TERMINAL) | {CANCELLED, FAILED}, _read_failed),
    "input.provided": (_T5["input.provided"][0], _replanning("input.provided")),
    "approval.invalidated": (_T5["approval.invalidated"][0], _replanning("approval.invalidated")),
    "dispatch.conflict": (_T5["dispatch.conflict"][0], _replanning("dispatch.conflict")),
    "intent.deferred": (_T5["intent.deferred"][0], _replanning("intent.deferred")),
    "approval.revalidated": (frozenset({VALIDATING}), _approval_revalidated),
    "approval.requested": (_T5["approval.requested"][0], _approval_requested),
    "input.requested": (_T5["input.requested"][0], _closing_held("input.requested")),
    "task.completed": (_T5["task.completed"][0], _closing_held("task.completed")),
    "intent.committed": (_T5["intent.committed"][0], _intent_committed),
}
EVENT_TYPES = tuple(TRANSITIONS)


def reduce(state: dict, event_type: str, payload: dict) -> dict:
    """δ of ``reducer/6``: ``reducer/5``'s, over :data:`TRANSITIONS`. Raises
    :class:`~apps.tasks.reducer.core.IllegalTransition` as ``reducer/5`` does, and for a plan version
    out of sequence, missing a premise or with a ticket epoch not the task's, a re-plan without its
    barrier, a barrier whose ``changed`` list is not the premises that changed or that lets a step
    continue whose premises changed, a read result for an activity never dispatched or already
    reported (or closed ``unjoined``), a result missing a premise or claiming one it was not dispatched
    under, a verdict that is not the one its premises give, and a held approval committed before its
    re-validation."""
    return r3.reduce_over(TRANSITIONS, state, event_type, payload)
