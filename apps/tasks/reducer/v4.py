"""δ version ``reducer/4``: service-level breaches on the record (issue: due dates and SLA;
spec §16 events as the one record of what happened).

``reducer/4`` is ``reducer/3`` (:mod:`apps.tasks.reducer.v3`) plus two events:

* ``sla.breached`` — ``{"kind": "respond" | "resolve", "due": ISO datetime, "priority": "P1".."P4",
  "observed_at": ISO datetime}``: the request was not answered (``respond``) or its ticket not
  resolved (``resolve``) by its due date under the tenant's service levels. Legal in every status,
  including the terminal ones (a ticket is resolved, or not, long after its request ended), once
  per kind; it changes no status, only ``state["sla"][kind]``.
* ``intent.deferred`` — ``{"action_id", "task_id", "reason", "priority"}``: one ticket per fault. At its intent
  to create a ticket the task found another report's ticket for the same device being created (or
  just created and open): instead of a second ticket it re-plans — like a conflict, the plan's
  reads are taken again (``RETRIEVING``) — once that action has settled, so that its ticket, if
  any, takes this report as a comment under the same approval rules. Legal in ``VALIDATING`` and
  ``WAITING_APPROVAL`` (an approved create is invalidated: a comment needs its own decision).
  ``state["coalesce"]`` names the action waited for until the next ``device.read``.

``draft.proposed`` also keeps, in ``state["ticket_due"]``, the first due date a draft of each
priority got: a re-draft (after a rejection, a conflict, a deferral) keeps its date, so a policy
edited meanwhile neither moves it nor makes a rejected proposal look new.
"""

from __future__ import annotations

from apps.tasks.reducer import core
from apps.tasks.reducer import v3 as r3
from apps.tasks.reducer.core import RETRIEVING, VALIDATING, WAITING_APPROVAL, require

VERSION = "reducer/4"

#: the due dates a breach can be of
SLA_KINDS = ("respond", "resolve")


def _sla_breached(s: dict, p: dict) -> None:
    kind = p.get("kind")
    require(kind in SLA_KINDS, s, "sla.breached", f"sla.breached needs a kind among {SLA_KINDS}")
    require(isinstance(p.get("due"), str) and isinstance(p.get("observed_at"), str), s, "sla.breached",
            "sla.breached needs its due date and when it was observed")
    sla = dict(s.get("sla") or {})
    require(kind not in sla, s, "sla.breached", f"the {kind} breach is already recorded")
    sla[kind] = {"due": p["due"], "observed_at": p["observed_at"], "priority": p.get("priority")}
    s["sla"] = sla


#: why a deferred intent invalidates the approval it was about to use
COALESCED_REASON = "another report's ticket for this device is being created: this report joins it"


def _intent_deferred(s: dict, p: dict) -> None:
    require(s["action"] is None, s, "intent.deferred", "an action is already committed")
    require(bool(p.get("action_id")) and bool(p.get("task_id")), s, "intent.deferred",
            "intent.deferred names the action and the task it waits for")
    if s["approval"] is not None and s["approval"]["status"] in ("PENDING", "APPROVED"):
        s["approval"] = {**s["approval"], "status": "INVALIDATED", "reason": COALESCED_REASON}
    s["coalesce"] = {"action_id": p["action_id"], "task_id": p["task_id"], "reason": p.get("reason", ""),
                     "priority": p.get("priority")}
    s["replans"] += 1
    for key in ("proposal", "draft", "evidence", "device", "ticket"):
        s[key] = None
    s["status"] = RETRIEVING


def _draft_proposed(s: dict, p: dict) -> None:
    r3.TRANSITIONS["draft.proposed"][1](s, p)
    ticket = (p.get("draft") or {}).get("ticket") or {}
    if isinstance(ticket, dict) and ticket.get("due_at") and ticket.get("priority"):
        # the due date a ticket of this priority got first: re-drafts keep it (see with_due_date)
        s["ticket_due"] = {**(s.get("ticket_due") or {}), ticket["priority"]: ticket["due_at"]}


def _device_read(s: dict, p: dict) -> None:
    r3.TRANSITIONS["device.read"][1](s, p)
    if s.get("coalesce") is not None:
        s["coalesce"] = None  # the plan's reads were taken again: the wait is over


#: The state table of ``reducer/4``: event type -> (statuses in which it is legal, handler).
TRANSITIONS = {
    **r3.TRANSITIONS,
    "sla.breached": (frozenset(core.ALL_STATUSES), _sla_breached),
    "intent.deferred": (frozenset({VALIDATING, WAITING_APPROVAL}), _intent_deferred),
    "device.read": (r3.TRANSITIONS["device.read"][0], _device_read),
    "draft.proposed": (r3.TRANSITIONS["draft.proposed"][0], _draft_proposed),
}
EVENT_TYPES = tuple(TRANSITIONS)


def reduce(state: dict, event_type: str, payload: dict) -> dict:
    """δ of ``reducer/4``: ``reducer/3``'s checks on the next state, over :data:`TRANSITIONS`.
    Raises :class:`~apps.tasks.reducer.core.IllegalTransition` as ``reducer/3`` does, and for an
    ``sla.breached`` without a known kind, its dates, or of a kind already recorded."""
    return r3.reduce_over(TRANSITIONS, state, event_type, payload)
