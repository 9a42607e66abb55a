"""Helpers every step shares: the actor string of a lease, recording a terminal failure, the
task's bounds and deadline, and closing reservations left by earlier leases."""

from __future__ import annotations

import contextvars
import logging
import uuid

from django.conf import settings
from django.utils import timezone

from apps.accounts.principal import principal_current
from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_invalidate
from apps.tasks import reducer
from apps.tasks.budget import budget_settle, stale_reservations
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v6
from apps.tasks.store import task_append_event

log = logging.getLogger(__name__)


MAX_STEPS_PER_RUN = 20

#: the pool of the run this context is in (``agent`` or ``tools``; :func:`apps.agent.runner.agent_run`
#: sets it), or None outside a run
RUN_POOL: contextvars.ContextVar[str | None] = contextvars.ContextVar("faultdesk_run_pool", default=None)
#: the pool of the context reads, which are tool calls: a ticket system's answer may be waited for here
TOOLS_POOL = "tools"


def actor_of(lease: Lease) -> str:
    return f"worker:{lease.owner}"


def fail(task: Task, lease: Lease, reason: str) -> Task:
    """Record the explicit terminal decision ``task.failed`` with ``reason``."""
    return task_append_event(task=task, event_type="task.failed", actor=actor_of(lease),
                             lease_generation=lease.generation,
                             payload={"reason": reason, "at": timezone.now().isoformat()})


def deadline_reason(task: Task) -> str:
    left = (task.deadline_at - timezone.now()).total_seconds()
    return (f"deadline_exceeded: {max(left, 0):.1f} s left, less than an activity needs plus "
            f"{settings.FAULTDESK['ACTIVITY_CLEANUP_SECONDS']:.0f} s to record its result")


def release_stale(task: Task, lease: Lease) -> Task:
    """Close the open reservations of earlier leases before this lease starts new activities
    (``reducer/3``): their workers died or were fenced and will never settle them. What they did
    is unknown — a model call may have been answered and billed — so each is charged at its
    reservation (``c = r``), which also bounds an activity that keeps crashing."""
    for rid in stale_reservations(task, lease.generation):
        task = budget_settle(task_id=task.pk, reservation_id=rid, actor=actor_of(lease),
                             lease_generation=lease.generation,
                             used=task.state["reservations"][rid]["amounts"],
                             extra={"unknown_outcome": True,
                                    "reason": f"made under an earlier lease (fencing token < {lease.generation}) "
                                              "and never settled: charged at its reservation"})
    return task


def bounds_exceeded(task: Task) -> str | None:
    """The first bound this task has hit (steps, re-plans — recursion depth —, conflicting
    conditional writes, and wall time; re-drafts are checked where drafting happens), as a
    termination reason, or None."""
    conf = settings.FAULTDESK
    if task.version >= conf["MAX_EVENTS_PER_TASK"]:
        return f"step_limit: {task.version} events (limit {conf['MAX_EVENTS_PER_TASK']})"
    # A 412 on a conditional write (another writer moved the ticket first: e.g. the comments of
    # several reports joining one ticket at once) is counted apart, under its own larger bound: it
    # is contention the ticket system settles, not a plan going round in circles.
    conflicts = task.state.get("conflicts", 0)
    if task.state.get("replans", 0) - conflicts > conf["MAX_REPLANS"]:
        return f"replan_limit: re-planned {task.state['replans'] - conflicts} times (limit {conf['MAX_REPLANS']})"
    if conflicts > conf["MAX_CONFLICTS"]:
        return f"conflict_limit: {conflicts} conflicting writes (limit {conf['MAX_CONFLICTS']})"
    if task.deadline_at <= timezone.now():
        return "deadline_exceeded"
    return None


def plans_comments(task: Task) -> bool:
    """Does the task's pinned reducer plan comments on an open ticket, conflicts and compensation
    (``reducer/2`` on)? A ``reducer/1`` task keeps ``reducer/1``'s plan: always a new ticket."""
    return reducer.supports((task.artifact_bundle or {}).get("reducer"), "comments")


def has_ledger(task: Task) -> bool:
    """Does the task's pinned reducer keep the budget ledger and record model calls (``reducer/3``)?"""
    return reducer.supports((task.artifact_bundle or {}).get("reducer"), "ledger")


def keeps_plans(task: Task) -> bool:
    """Does the task's pinned reducer keep plan versions with premises and read in parallel
    (``reducer/6``)?"""
    return reducer.supports((task.artifact_bundle or {}).get("reducer"), "plans")


def cancel_requested(task_id: uuid.UUID) -> bool:
    """Has the task been cancelled (or ended) since this worker started its activity?"""
    row = Task.objects.filter(pk=task_id).values("status", "state__cancel_requested").first()
    return row is None or row["status"] in reducer.TERMINAL or bool(row["state__cancel_requested"])


REQUESTER_GONE = "requester no longer holds a requester role in the tenant"


def requester_gone(task: Task) -> bool:
    """The requester's membership, role or account (``User.is_active``) is gone now."""
    requester = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    return requester is None or not requester.is_requester


def invalidating(approval: ApprovalRequest, reason: str):
    """A ``side_effects`` callback that marks ``approval`` invalidated in the event's transaction."""
    def apply(task: Task, event) -> None:
        approval_invalidate(approval=approval, reason=reason)

    return apply


def closing_held(task: Task, event_type: str):
    """The ``side_effects`` callback for appending ``event_type`` (``input.requested``,
    ``task.completed``) to ``task`` now: when it closes the approval held for re-validation
    (``reducer/6``: :func:`apps.tasks.reducer.v6.held_closed_by`), it marks that approval's row
    invalidated with the reason δ records (:func:`~apps.tasks.reducer.v6.closing_reason`), in the
    event's transaction, so the row says what the state says; otherwise None."""
    approval_id = v6.held_closed_by(task.state or {}, event_type)
    if approval_id is None:
        return None
    reason = v6.closing_reason(task.state or {}, event_type)

    def apply(t: Task, event) -> None:
        approval = ApprovalRequest.objects.for_tenant(t.tenant_id).filter(pk=approval_id).first()
        if approval is not None:
            approval_invalidate(approval=approval, reason=reason)

    return apply
