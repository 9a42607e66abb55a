"""δ version ``reducer/3``: the budget ledger and recorded model calls (DESIGN.md §8, §10;
spec §16.5 "预算、异步及取消", runtime-invariants.md §1.2).

``reducer/3`` is ``reducer/2`` (:mod:`apps.tasks.reducer.v2`) plus a ledger with several limits:

* ``budget`` — money-like cost units: total ``B``, settled ``U``, reserved ``R`` (as before);
* ``limits`` — ``tokens`` (model tokens), ``tool_calls`` and ``retries``, each
  ``{"total", "used", "reserved"}`` with the same invariant ``used + reserved ≤ total``;
* ``reservations`` — the open reservations of activities (a model call, a group of tool reads):
  ``{id: {"activity", "amounts": {"money", "tokens", "tool_calls", "retries"}, "generation",
  "timeout_s"}}``.

An activity ``j`` is admitted only by ``budget.reserved`` with amounts ``r_j``, legal only while
``U + R + r_j ≤ B`` holds for every dimension. It ends by ``budget.settled`` or ``model.called``
(``U += c_j, R -= r_j`` with ``0 ≤ c_j ≤ r_j`` per dimension), or by ``budget.released`` (unused:
``R -= r_j``). ``task.completed`` and ``task.failed`` release whatever is still open. A cancel
does not: an activity in flight is signalled, stops and settles what it really cost; one whose
worker died is released by the sweeper once its lease expired. A committed write counts one tool
call at its intent.

``model.called`` records one call to the pinned model: outcome, usage, cost, latency and the raw
output (before anything uses it). ``state["model"]`` counts the re-asks of the current draft and
keeps the last call's problems for the re-ask prompt. ``draft.invalid`` keeps its problems there
too, for the re-draft prompt.
"""

from __future__ import annotations

from apps.tasks.reducer import core
from apps.tasks.reducer import v1 as r1
from apps.tasks.reducer import v2 as r2
from apps.tasks.reducer.core import (
    CANCELLED,
    FAILED,
    NON_TERMINAL,
    PROPOSING,
    RETRIEVING,
    VALIDATING,
    require,
)

VERSION = "reducer/3"

#: the ledger's dimensions; ``money`` is ``state["budget"]`` (the task row's budget columns)
DIMENSIONS = ("money", "tokens", "tool_calls", "retries")
LIMITS = ("tokens", "tool_calls", "retries")

#: model call outcomes that settle at zero (the provider refused before doing any work)
MODEL_OUTCOMES = ("ok", "malformed", "rate_limited", "unavailable", "timeout", "cancelled", "error")


def _account(s: dict, dim: str) -> dict:
    return s["budget"] if dim == "money" else s["limits"][dim]


def _set_account(s: dict, dim: str, value: dict) -> None:
    if dim == "money":
        s["budget"] = value
    else:
        s["limits"] = {**s["limits"], dim: value}


def _amounts(p: dict, key: str, etype: str, s: dict) -> dict:
    raw = p.get(key) or {}
    require(set(raw) <= set(DIMENSIONS), s, etype, f"unknown ledger dimension in {sorted(raw)}")
    out = {d: raw.get(d, 0) for d in DIMENSIONS}
    require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in out.values()), s, etype,
             "ledger amounts are non-negative integers")
    return out


def headroom(state: dict) -> dict:
    """``{dimension: total - used - reserved}`` of ``state`` (what a new reservation may take)."""
    return {d: core.account_room(_account(state, d)) for d in DIMENSIONS}


# --- task.accepted -------------------------------------------------------------------------------

def _accepted(s: dict, p: dict) -> None:
    r2._accepted(s, p)
    limits = p["limits"]
    s["limits"] = {d: {"total": int(limits[d]), "used": 0, "reserved": 0} for d in LIMITS}
    s["reservations"] = {}
    s["model"] = {"calls": 0, "reasks": 0, "last": None, "feedback": None}


# --- reservations --------------------------------------------------------------------------------

def _budget_reserved(s: dict, p: dict) -> None:
    rid = p["reservation_id"]
    require(rid not in s["reservations"], s, "budget.reserved", "reservation id already used")
    amounts = _amounts(p, "amounts", "budget.reserved", s)
    for dim in DIMENSIONS:
        acct, r = _account(s, dim), amounts[dim]
        refusal = core.admission_refusal(acct, r, what=dim)
        require(refusal is None, s, "budget.reserved", refusal or "")
    for dim in DIMENSIONS:
        acct = _account(s, dim)
        _set_account(s, dim, {**acct, "reserved": acct["reserved"] + amounts[dim]})
    s["reservations"] = {**s["reservations"], rid: {
        "activity": p["activity"], "amounts": amounts, "generation": p.get("generation"),
        "timeout_s": p.get("timeout_s")}}


def _settle(s: dict, p: dict, etype: str) -> None:
    rid = p["reservation_id"]
    require(rid in s["reservations"], s, etype,
             "no open reservation with this id (settled, released, or never made): a late result")
    reserved = s["reservations"][rid]["amounts"]
    used = _amounts(p, "used", etype, s)
    for dim in DIMENSIONS:
        require(used[dim] <= reserved[dim], s, etype,
                 f"{dim}: cost {used[dim]} exceeds reservation {reserved[dim]} (c ≤ r)")
    for dim in DIMENSIONS:
        acct = _account(s, dim)
        _set_account(s, dim, {**acct, "used": acct["used"] + used[dim], "reserved": acct["reserved"] - reserved[dim]})
    s["reservations"] = {k: v for k, v in s["reservations"].items() if k != rid}


def _budget_settled(s: dict, p: dict) -> None:
    _settle(s, p, "budget.settled")


def _release_all(s: dict, ids) -> None:
    for rid in ids:
        reserved = s["reservations"][rid]["amounts"]
        for dim in DIMENSIONS:
            acct = _account(s, dim)
            _set_account(s, dim, {**acct, "reserved": acct["reserved"] - reserved[dim]})
    s["reservations"] = {k: v for k, v in s["reservations"].items() if k not in set(ids)}


def _budget_released(s: dict, p: dict) -> None:
    ids = list(p["reservation_ids"])
    require(bool(ids) and all(rid in s["reservations"] for rid in ids), s, "budget.released",
             "every released reservation must be open")
    _release_all(s, ids)


# --- model calls ---------------------------------------------------------------------------------

def _model_called(s: dict, p: dict) -> None:
    require(p["outcome"] in MODEL_OUTCOMES, s, "model.called", f"unknown outcome {p['outcome']!r}")
    _settle(s, p, "model.called")
    m = s["model"]
    last = {"call_id": p["reservation_id"], "outcome": p["outcome"], "problems": p.get("problems") or []}
    s["model"] = {**m, "calls": m["calls"] + 1, "last": last,
                  "reasks": m["reasks"] + (1 if p["outcome"] == "malformed" else 0)}


def _draft_proposed(s: dict, p: dict) -> None:
    r1._draft_proposed(s, p)
    s["model"] = {**s["model"], "reasks": 0, "last": None}


def _draft_invalid(s: dict, p: dict) -> None:
    r1._draft_invalid(s, p)
    s["model"] = {**s["model"], "feedback": list(p.get("problems") or [])}


# --- writes count one tool call at their intent ----------------------------------------------------

def _intent_committed(s: dict, p: dict) -> None:
    acct = s["limits"]["tool_calls"]
    refusal = core.admission_refusal(acct, 1, what="tool_calls")
    require(refusal is None, s, "intent.committed", refusal or "")
    r2._intent_committed(s, p)
    s["limits"] = {**s["limits"], "tool_calls": {**acct, "used": acct["used"] + 1}}


# --- ends release what is still reserved -------------------------------------------------------------

def _releasing(handler):
    def apply(s: dict, p: dict) -> None:
        handler(s, p)
        _release_all(s, list(s["reservations"]))
        _close_pending_approval(s, "the task ended")
    return apply


def _close_pending_approval(s: dict, why: str) -> None:
    """The state shows what the approval row says: a task that ends or is cancelled leaves no
    approval pending (the row is invalidated in the same transaction)."""
    a = s.get("approval")
    if a is not None and a.get("status") == "PENDING":
        s["approval"] = {**a, "status": "INVALIDATED", "reason": why}


def _cancel_requested(s: dict, p: dict) -> None:
    r1._cancel_requested(s, p)
    _close_pending_approval(s, "the task was cancelled")


def _input_provided(s: dict, p: dict) -> None:
    r2.TRANSITIONS["input.provided"][1](s, p)
    s["model"] = {**s["model"], "feedback": None}


_T2 = r2.TRANSITIONS
_ACTIVE = frozenset({RETRIEVING, PROPOSING, VALIDATING})
#: a result may settle its reservation whenever one can be open: while the task runs, and after a
#: cancel (the activity in flight reports what it cost; its output is not used)
_SETTLEABLE = frozenset(NON_TERMINAL) | {CANCELLED, FAILED, core.COMPENSATING, core.WAITING_COMPENSATION}

#: The state table of ``reducer/3``: event type -> (statuses in which it is legal, handler).
TRANSITIONS = {
    **_T2,
    "task.accepted": (_T2["task.accepted"][0], _accepted),
    "budget.reserved": (_ACTIVE, _budget_reserved),
    "budget.settled": (_SETTLEABLE, _budget_settled),
    "budget.released": (_SETTLEABLE | {core.COMPLETED}, _budget_released),
    "model.called": (_SETTLEABLE, _model_called),
    "draft.proposed": (_T2["draft.proposed"][0], _draft_proposed),
    "draft.invalid": (_T2["draft.invalid"][0], _draft_invalid),
    "input.provided": (_T2["input.provided"][0], _input_provided),
    "intent.committed": (_T2["intent.committed"][0], _intent_committed),
    "task.completed": (_T2["task.completed"][0], _releasing(_T2["task.completed"][1])),
    "task.failed": (_T2["task.failed"][0], _releasing(_T2["task.failed"][1])),
    "cancel.requested": (_T2["cancel.requested"][0], _cancel_requested),
}
EVENT_TYPES = tuple(TRANSITIONS)


def reduce(state: dict, event_type: str, payload: dict) -> dict:
    """δ of ``reducer/3``: the next state for ``event_type`` with ``payload``. Never mutates
    ``state``. Raises :class:`~apps.tasks.reducer.core.IllegalTransition` as ``reducer/2`` does, and when
    a reservation would take any dimension past its total, a settlement exceeds its reservation
    or names no open reservation, or a ledger account goes out of ``0 ≤ used + reserved ≤ total``."""
    return reduce_over(TRANSITIONS, state, event_type, payload)


def reduce_over(transitions: dict, state: dict, event_type: str, payload: dict) -> dict:
    """δ over ``transitions`` (``reducer/3``'s table or a later version's) with ``reducer/3``'s
    ledger check on the next state: every limit keeps ``0 ≤ used + reserved ≤ total``. Raises
    :class:`~apps.tasks.reducer.core.IllegalTransition` otherwise."""
    nxt = core.reduce_with(transitions, state, event_type, payload)
    for dim in LIMITS:
        acct = nxt["limits"][dim]
        if core.account_broken(acct):
            raise core.IllegalTransition(state.get("status"), event_type, f"{dim} ledger invariant broken: {acct}")
    return nxt
