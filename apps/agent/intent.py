"""The intent (DESIGN.md §1 step 6): in one transaction the CAS + fencing commit of
``intent.committed``, the action with its idempotency key and the outbox row, each written by the
service of the app that owns it."""

from __future__ import annotations

import logging
import uuid

from apps.actions.digest import action_digest, idempotency_key
from apps.actions.models import Action
from apps.actions.registry import ParamsInvalid, params_validate, tool_get
from apps.actions.services import action_create
from apps.agent.common import (
    REQUESTER_GONE,
    actor_of,
    has_ledger,
    invalidating,
    requester_gone,
)
from apps.approvals.models import ApprovalRequest
from apps.core import sql
from apps.outbox.services import outbox_enqueue
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v3 as reducer_v3
from apps.tasks.store import refused_event_record, task_append_event
from apps.tickets.connectors import CONNECTORS

log = logging.getLogger(__name__)


def write_short(task: Task, tool) -> str | None:
    """``reducer/3``: why the task's ledger has no room left for ``tool``'s write (its cost units
    and one tool call), as a termination reason; None when it fits. Checked before an approval is
    asked for and before the intent, so a write the budget cannot pay ends in a decision."""
    if not has_ledger(task):
        return None
    room = reducer_v3.headroom(task.state)
    for dim, need in (("money", tool.cost_units), ("tool_calls", 1)):
        if need > room[dim]:
            return f"budget_exhausted: task {dim}: the {tool.name} write needs {need}, {max(room[dim], 0)} left"
    return None


def commit_intent(task: Task, lease: Lease, *, proposal: dict, approval: ApprovalRequest | None,
                   object_version: int, compensates: Action | None = None) -> bool:
    """DESIGN.md §1 step 6: in ONE transaction — CAS on task version + fencing token, budget
    reservation (checked by δ: U + R + r ≤ B), the action identity with its idempotency key, the
    intent event and the outbox row. The dispatcher is kicked on commit. Parameters that do not
    match the tool's schema, or a reused key, are refused before any row is written; parameters
    whose recomputed h(a) is not the approval's invalidate it (the task asks again).
    ``compensates``: the action whose effect this one compensates (``reducer/2``). Returns True
    when the agent should take another step now (the approval was invalidated)."""
    tool = tool_get(proposal["tool"])
    if short := write_short(task, tool):
        task_append_event(task=task, event_type="compensation.failed" if compensates is not None else "task.failed",
                          actor=actor_of(lease), lease_generation=lease.generation, payload={"reason": short})
        return False
    if compensates is None and requester_gone(task):
        # Also where no approval was needed: the person the ticket is filed for must still be one.
        task_append_event(task=task, event_type="task.failed", actor=actor_of(lease), lease_generation=lease.generation,
                          payload={"reason": REQUESTER_GONE})
        return False
    try:
        params_validate(tool.name, proposal["params"])
    except ParamsInvalid as exc:
        refused_event_record(task=task, event_type="intent.committed", payload={"digest": proposal["digest"]},
                             reason=str(exc), actor=actor_of(lease), lease_generation=lease.generation)
        event = "compensation.failed" if compensates is not None else "task.failed"
        task_append_event(task=task, event_type=event, actor=actor_of(lease), lease_generation=lease.generation,
                          payload={"reason": f"invalid parameters: {exc}"})
        return False
    # h(a) of what is committed now — the tool at its current version, the parameters as they
    # are — recomputed: a stored digest is only a label that may have been left behind.
    digest = action_digest(tool=tool.name, tool_version=tool.version, params=proposal["params"])
    if approval is not None and digest != approval.action_digest:
        reason = "the parameters to commit differ from the approved ones (h(a) recomputed at the intent)"
        refused_event_record(task=task, event_type="intent.committed", payload={"digest": digest}, reason=reason,
                             actor=actor_of(lease), lease_generation=lease.generation)
        task_append_event(task=task, event_type="approval.invalidated", actor=actor_of(lease),
                          lease_generation=lease.generation,
                          payload={"approval_id": str(approval.pk), "reason": reason},
                          side_effects=invalidating(approval, reason))
        return True
    # The ticket system this action goes to, fixed now (a compensation: where its ticket is). The
    # approval's effects name the system it was asked for: another one is not what was approved.
    connector = compensates.connector if compensates is not None else task.tenant.ticket_system
    if approval is not None and f"in {CONNECTORS[connector].label}" not in approval.side_effects:
        reason = f"the ticket system changed since approval (now {CONNECTORS[connector].label})"
        task_append_event(task=task, event_type="approval.invalidated", actor=actor_of(lease),
                          lease_generation=lease.generation,
                          payload={"approval_id": str(approval.pk), "reason": reason},
                          side_effects=invalidating(approval, reason))
        return True
    action_id = uuid.uuid4()
    key = idempotency_key(tenant_slug=task.tenant.slug, tool=tool.name, task_id=str(task.pk),
                          digest=digest, intent_seq=task.version + 1)
    reused = sql.row(Action, "t0.idempotency_key = %s", [key], tenant_id=task.tenant_id)  # (tenant, key) is unique
    if reused is not None:
        # One key, one logical action: a key already bound to other parameters (or to another
        # action) is refused before any action or outbox row is written.
        reason = (f"idempotency key {key} is already bound to action {reused.pk} "
                  f"({'other parameters' if reused.params_digest != digest else 'the same parameters'})")
        refused_event_record(task=task, event_type="intent.committed", payload={"idempotency_key": key,
                             "digest": digest}, reason=reason, actor=actor_of(lease),
                             lease_generation=lease.generation)
        event = "compensation.failed" if compensates is not None else "task.failed"
        task_append_event(task=task, event_type=event, actor=actor_of(lease), lease_generation=lease.generation,
                          payload={"reason": "idempotency key reused: the intent was refused"})
        return False
    params = proposal["params"]
    ordering_key = f"ticket:{connector}:{params['ticket_id']}" if tool.object_scope == "ticket" \
        else f"{tool.name}:{key}"

    def write_action(t: Task, event) -> None:
        action = action_create(action_id=action_id, tenant_id=t.tenant_id, task_id=t.pk, tool=tool, connector=connector,
                               params=params, params_digest=digest, idempotency_key=key, approval=approval,
                               object_version=object_version, compensates=compensates)
        outbox_enqueue(action=action, ordering_key=ordering_key)

    task_append_event(
        task=task, event_type="intent.committed", actor=actor_of(lease), lease_generation=lease.generation,
        payload={"action_id": str(action_id), "idempotency_key": key, "digest": digest,
                 "reservation": tool.cost_units, "approval_required": approval is not None,
                 "approval_id": str(approval.pk) if approval else None,
                 "proposal": proposal if approval is None else None, "object_version": object_version,
                 "connector": connector},
        side_effects=write_action,
    )
    return False
