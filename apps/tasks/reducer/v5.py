"""δ version ``reducer/5``: a rejection is a constraint that survives re-wording (spec §16.6: a
rejection is feedback to the planner, not a transient error to retry).

``reducer/5`` is ``reducer/4`` (:mod:`apps.tasks.reducer.v4`) plus ``state["rejections"]``:
``[{"approval_id", "identity": {"tool", "target", "change"}, "digest", "reason", "decided_by"}]``.

* ``approval.rejected`` of the task's own proposal appends the rejected action's identity
  (:func:`apps.actions.digest.action_identity`: the tool, the object it writes and the kind of
  change — never its wording) with the approver's reason, and hands the reason to the next draft
  as feedback (``state["model"]["feedback"]``). A rejected compensation is ``reducer/2``'s, unchanged.
* ``approval.requested`` and an ``intent.committed`` that needs no approval are refused for a
  proposal whose identity was rejected earlier in the task, whatever its wording: only a
  materially different action (another target, another kind of change) may be asked for again.
"""

from __future__ import annotations

from apps.actions.digest import action_identity
from apps.tasks.reducer import v3 as r3
from apps.tasks.reducer import v4 as r4
from apps.tasks.reducer.core import WAITING_APPROVAL, require

VERSION = "reducer/5"


def identity_of(proposal: dict | None) -> dict | None:
    """The identity of ``proposal`` (``{tool, params, …}``), or None without one."""
    if not isinstance(proposal, dict) or not proposal.get("tool"):
        return None
    return action_identity(tool=proposal["tool"], params=proposal.get("params") or {})


def rejected_identity(state: dict, proposal: dict | None) -> dict | None:
    """The earlier rejection (an entry of ``state["rejections"]``) whose identity ``proposal``
    has, or None when no rejection in the task covers it."""
    identity = identity_of(proposal)
    if identity is None:
        return None
    return next((r for r in state.get("rejections") or [] if r["identity"] == identity), None)


def _approval_requested(s: dict, p: dict) -> None:
    earlier = rejected_identity(s, p.get("proposal"))
    require(earlier is None, s, "approval.requested",
            f"the same action ({(earlier or {}).get('identity')}) was rejected earlier in the task: "
            f"{(earlier or {}).get('reason') or 'no reason given'}")
    r4.TRANSITIONS["approval.requested"][1](s, p)


def _approval_rejected(s: dict, p: dict) -> None:
    own = s["status"] == WAITING_APPROVAL and s.get("approval") is not None \
        and s["approval"]["id"] == p.get("approval_id")
    proposal, approval = s.get("proposal"), s.get("approval")
    r4.TRANSITIONS["approval.rejected"][1](s, p)
    if not own:
        return  # a compensation's rejection
    identity = identity_of(proposal)
    reason = p.get("reason", "") or ""
    if identity is not None:
        s["rejections"] = [*(s.get("rejections") or []),
                           {"approval_id": approval["id"], "identity": identity, "digest": approval["digest"],
                            "reason": reason, "decided_by": p.get("decided_by")}]
    if isinstance(s.get("model"), dict):
        target = f" ({identity['tool']} on {identity['target']})" if identity else ""
        s["model"] = {**s["model"], "feedback": [
            f"An approver rejected the previous proposal{target}: {reason or 'no reason given'}. The same action "
            f"reworded will not be asked for again."]}


def _intent_committed(s: dict, p: dict) -> None:
    if s["status"] != WAITING_APPROVAL and p.get("proposal") is not None:
        earlier = rejected_identity(s, p["proposal"])
        require(earlier is None, s, "intent.committed",
                f"the same action ({(earlier or {}).get('identity')}) was rejected earlier in the task")
    r4.TRANSITIONS["intent.committed"][1](s, p)


#: The state table of ``reducer/5``: event type -> (statuses in which it is legal, handler).
TRANSITIONS = {
    **r4.TRANSITIONS,
    "approval.requested": (r4.TRANSITIONS["approval.requested"][0], _approval_requested),
    "approval.rejected": (r4.TRANSITIONS["approval.rejected"][0], _approval_rejected),
    "intent.committed": (r4.TRANSITIONS["intent.committed"][0], _intent_committed),
}
EVENT_TYPES = tuple(TRANSITIONS)


def reduce(state: dict, event_type: str, payload: dict) -> dict:
    """δ of ``reducer/5``: ``reducer/4``'s, over :data:`TRANSITIONS`. Raises
    :class:`~apps.tasks.reducer.core.IllegalTransition` as ``reducer/4`` does, and for an approval
    request or an unapproved intent whose action's identity was rejected earlier in the task."""
    return r3.reduce_over(TRANSITIONS, state, event_type, payload)
