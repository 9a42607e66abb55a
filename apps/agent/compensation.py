"""Compensation (DESIGN.md §6 "saga"; spec table 16.5 "取消后收到回执"): a ticket created although its
request was cancelled is closed by a new, approved, conditional ``ticket.update``."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.accounts.models import Membership
from apps.actions.digest import action_digest, proposal_digest
from apps.actions.models import Action, ActionStatus
from apps.actions.registry import tool_get
from apps.agent.authorization import (
    approval_granted,
    invalidated_unless_bound,
)
from apps.agent.common import (
    actor_of,
    plans_comments,
)
from apps.agent.intent import commit_intent
from apps.approvals.policy import policy_decide
from apps.approvals.services import approval_request_create
from apps.core import tool_errors as errors
from apps.events.models import TaskEvent
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v2 as reducer_v2
from apps.tasks.reducer.core import admission_refusal
from apps.tasks.runs import checkpoint
from apps.tasks.store import task_append_event
from apps.tickets.connectors import CONNECTORS, connector_for
from apps.tickets.selectors import ticket_snapshot

log = logging.getLogger(__name__)


COMPENSATION_REASON = "the request was cancelled after its ticket was created"


def _canceller_id(task: Task) -> int:
    """The user who asked for the cancel that this compensation follows (the actor of the task's
    last ``cancel.requested``, a member of its tenant) — the one who "asked" for the compensation,
    so that person cannot approve it; the requester when it cannot be told."""
    cancel = (TaskEvent.objects.for_tenant(task.tenant_id).filter(task_id=task.pk, type="cancel.requested")
              .order_by("-seq").values_list("actor", flat=True).first()) or ""
    if cancel.startswith("user:"):
        member = (Membership.objects.for_tenant(task.tenant_id).filter(user__username=cancel[len("user:"):])
                  .values_list("user_id", flat=True).first())
        if member is not None:
            return member
    return task.requester_id


def compensation_due(task: Task) -> bool:
    """A cancelled ``reducer/2`` task whose ticket was created anyway (a late receipt, or a receipt
    just before the cancel) and whose compensation was not asked for yet. A comment is not
    compensated: it cannot be taken back, and it created nothing."""
    state = task.state
    receipt = state.get("receipt")
    return plans_comments(task) and state.get("compensation") is None and receipt is not None \
        and receipt.get("kind", "ticket") == "ticket"


def created_ticket(receipt: dict) -> dict:
    return {"connector": receipt.get("connector", "reference"), "external_id": receipt["external_id"],
            "version": int(receipt["version"]), "status": receipt.get("status"), "priority": None, "title": ""}


def compensation_request(task: Task, lease: Lease, *, ticket: dict) -> bool:
    """Ask to close ``ticket`` (as read) as a new ``ticket.update`` action with its own approval,
    conditional on the version read. A ticket system without conditional writes cannot do it
    safely: the compensation then waits for a person at once."""
    gen, actor, state = lease.generation, actor_of(lease), task.state
    connector = ticket["connector"]
    base = {"reason": COMPENSATION_REASON, "ticket": ticket, "requested_at": timezone.now().isoformat()}
    if not CONNECTORS[connector].supports_conditional_writes:
        task_append_event(task=task, event_type="compensation.requested", actor=actor, lease_generation=gen,
                          payload={**base, "outcome": "needs_person",
                                   "note": f"{CONNECTORS[connector].label} has no conditional update: close ticket "
                                           f"{ticket['external_id']} there by hand, then record it here"})
        return False
    others = _other_reports_on(task, ticket)
    if others:
        # Closing it would bury another request's live report: the ticket stays open.
        task_append_event(task=task, event_type="compensation.requested", actor=actor, lease_generation=gen,
                          payload={**base, "outcome": "not_needed", "by": actor,
                                   "note": f"ticket {ticket['external_id']} also carries the reports of "
                                           f"{len(others)} other request(s) ({', '.join(others[:5])}); it stays open"})
        return False
    tool = tool_get("ticket.update")
    params = {"ticket_id": ticket["external_id"], "if_match": ticket["version"], "reason": COMPENSATION_REASON,
              "changes": {"status": "closed",
                          "comment": f"Closed by faultdesk: {COMPENSATION_REASON} (task {task.pk})."}}
    digest = action_digest(tool=tool.name, tool_version=tool.version, params=params)
    proposal = {"tool": tool.name, "tool_version": tool.version, "params": params, "digest": digest}
    decision = policy_decide(tenant_id=task.tenant_id, tool=tool.name)  # approval needed whatever it says
    approval_id, expires_at = uuid.uuid4(), timezone.now() + decision.ttl

    def create_approval(t: Task, event) -> None:
        approval_request_create(
            approval_id=approval_id, task=t, requested_by_id=_canceller_id(t), proposal=proposal, decision=decision,
            object_type="ticket", object_id=ticket["external_id"], object_version=ticket["version"],
            scope=f"{t.tenant.slug}:{tool.name}:ticket/{ticket['external_id']}",
            side_effects=f"Compensation: closes ticket {ticket['external_id']} in {CONNECTORS[connector].label}, "
                         f"which was created although the request was cancelled; only while the ticket is still "
                         f"at version {ticket['version']} (If-Match). Rejecting leaves the ticket open.",
            evidence=state.get("evidence") or [], expires_at=expires_at,
        )

    task_append_event(task=task, event_type="compensation.requested", actor=actor, lease_generation=gen,
                      payload={**base, "proposal": proposal, "approval_id": str(approval_id),
                               "policy_version": decision.policy_version, "expires_at": expires_at.isoformat()},
                      side_effects=create_approval)
    return False


def _other_reports_on(task: Task, ticket: dict) -> list[str]:
    """Ids of other tasks whose comments on ``ticket`` were written or may still be (anything but
    not sent / failed): their requesters were told their report is on that ticket."""

    rows = (Action.objects.for_tenant(task.tenant_id)
            .filter(tool="ticket.comment", connector=ticket["connector"], params__ticket_id=ticket["external_id"])
            .exclude(task_id=task.pk).exclude(status__in=[ActionStatus.NOT_SENT, ActionStatus.FAILED])
            .values_list("task_id", flat=True).distinct())
    return sorted(str(t) for t in rows)


def compensate(task: Task, lease: Lease) -> bool:
    """COMPENSATING: re-plan (re-read the ticket), or act on the compensation's approval."""
    gen, actor, state = lease.generation, actor_of(lease), task.state
    c = state["compensation"]
    if c["status"] == reducer_v2.C_REPLANNING:
        limit = settings.FAULTDESK["MAX_COMPENSATION_REPLANS"]
        if c["conflicts"] + c["replans"] >= limit:
            task_append_event(task=task, event_type="compensation.failed", actor=actor, lease_generation=gen,
                              payload={"reason": f"gave up after {c['conflicts']} conflicts and {c['replans']} "
                                                 f"re-plans (limit {limit}): the ticket keeps changing"})
            return False
        try:
            with checkpoint():  # a read at the ticket system, outside any transaction
                current = connector_for("ticket.update", c["ticket"]["connector"]).get_ticket(
                    external_id=c["ticket"]["external_id"])
        except errors.ToolError as exc:
            started = parse_datetime(c.get("started_at") or "") or task.updated_at
            window = timedelta(seconds=settings.FAULTDESK["TASK_DEADLINE_SECONDS"])
            if timezone.now() - started > window:
                task_append_event(task=task, event_type="compensation.failed", actor=actor, lease_generation=gen,
                                  payload={"reason": f"the ticket system could not be read within "
                                                     f"{int(window.total_seconds())} s of the compensation's "
                                                     f"start ({exc.code})"})
                return False
            log.info("compensation of %s: the ticket cannot be read now (%s)", task.pk, exc)
            return False  # the sweeper brings the task back
        if current is None or current.get("status") in ("resolved", "closed"):
            note = "the ticket no longer exists" if current is None else f"the ticket is already {current['status']}"
            task_append_event(task=task, event_type="compensation.resolved", actor=actor, lease_generation=gen,
                              payload={"outcome": "not_needed", "by": actor, "note": note})
            return False
        return compensation_request(task, lease, ticket=ticket_snapshot(current, c["ticket"]["connector"]))
    if c["status"] != reducer_v2.C_WAITING_APPROVAL or c.get("approval") is None:
        return False  # DISPATCHING: the outbox acts
    approval, moved = approval_granted(task, lease, c["approval"])
    if approval is None:
        return moved
    if invalidated_unless_bound(task, lease, approval, proposal_digest(c["proposal"])):
        return True
    if refusal := admission_refusal(state["budget"], tool_get(c["proposal"]["tool"]).cost_units):
        task_append_event(task=task, event_type="compensation.failed", actor=actor, lease_generation=gen,
                          payload={"reason": refusal})
        return False
    original = Action.objects.for_tenant(task.tenant_id).get(pk=state["action"]["id"])
    return commit_intent(task, lease, proposal=c["proposal"], approval=approval,
                          object_version=c["ticket"]["version"], compensates=original)
