"""The kernel every reducer version shares (DESIGN.md §4; spec §16.3): the task's statuses, the
refusal :class:`IllegalTransition`, the guard :func:`require`, the ledger's one admission check
(``U + R + r ≤ B``) and :func:`reduce_with`, δ over a version's state table. Pure: no I/O, no
clock, no randomness."""

from __future__ import annotations

import copy
from collections.abc import Callable
from enum import StrEnum


class Status(StrEnum):
    """Every status of every carried reducer version (spec §16.3). A ``StrEnum``: a member *is* its
    name as a string, so states stored as JSON, model choices and comparisons with plain strings
    read and write exactly as before."""

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
    COMPENSATING = "COMPENSATING"
    WAITING_COMPENSATION = "WAITING_COMPENSATION"


ACCEPTED = Status.ACCEPTED
RETRIEVING = Status.RETRIEVING
PROPOSING = Status.PROPOSING
VALIDATING = Status.VALIDATING
WAITING_INPUT = Status.WAITING_INPUT
WAITING_APPROVAL = Status.WAITING_APPROVAL
DISPATCHING = Status.DISPATCHING
WAITING_RECONCILIATION = Status.WAITING_RECONCILIATION
COMPLETED = Status.COMPLETED
FAILED = Status.FAILED
CANCELLED = Status.CANCELLED

STATUSES = (
    ACCEPTED, RETRIEVING, PROPOSING, VALIDATING, WAITING_INPUT, WAITING_APPROVAL, DISPATCHING,
    WAITING_RECONCILIATION, COMPLETED, FAILED, CANCELLED,
)
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})
NON_TERMINAL = tuple(s for s in STATUSES if s not in TERMINAL)

# Statuses only ``reducer/2`` (apps.tasks.reducer.v2) reaches: a cancelled task closing the ticket it
# created anyway (a compensation), and a failed compensation waiting for a person.
COMPENSATING = Status.COMPENSATING
WAITING_COMPENSATION = Status.WAITING_COMPENSATION
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


Handler = Callable[[dict, dict], None]


class UnknownReducer(Exception):
    """The task is pinned to a reducer version this build neither carries nor can migrate."""


def require(cond: bool, s: dict, etype: str, reason: str) -> None:
    if not cond:
        raise IllegalTransition(s["status"], etype, reason)


def admission_refusal(account: dict, amount: int, *, what: str = "budget") -> str | None:
    """The ledger's one admission check (DESIGN.md §8; spec §16.5): may ``amount`` (r, an int) be
    reserved on ``account`` (``{"total": B, "used": U, "reserved": R}``)? None when ``r ≥ 0`` and
    ``U + R + r ≤ B``; otherwise the refusal, ``"<what>: U+R+r = U+R+r exceeds B=B"``."""
    if amount >= 0 and account["used"] + account["reserved"] + amount <= account["total"]:
        return None
    return (f"{what}: U+R+r = {account['used']}+{account['reserved']}+{amount} exceeds "
            f"B={account['total']}")


def account_room(account: dict) -> int:
    """``B - U - R`` of a ledger ``account``: what a new reservation may take (may be negative
    only for an account already out of its invariant)."""
    return account["total"] - account["used"] - account["reserved"]


def account_broken(account: dict) -> bool:
    """Is ``account`` out of the ledger invariant ``0 ≤ R`` and ``U + R ≤ B``?"""
    return account["reserved"] < 0 or admission_refusal(account, 0) is not None


def copy_state(value):
    """A deep copy of a JSON-shaped ``value`` (dicts, lists, strings — statuses included —,
    numbers, booleans, None), as :func:`copy.deepcopy` makes it but without its memo: about twice
    as fast on a task's state, which δ copies at every event. Shared sub-objects come out as
    separate copies, as they would after the state's JSON round trip through the database. Any
    other type is handed to :func:`copy.deepcopy`."""
    if type(value) is dict:
        return {k: copy_state(v) for k, v in value.items()}
    if type(value) is list:
        return [copy_state(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    return copy.deepcopy(value)


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
    nxt = copy_state(state)
    handler(nxt, payload)
    b = nxt["budget"]
    if account_broken(b):
        raise IllegalTransition(status, event_type, f"budget invariant broken: {b}")
    return nxt
