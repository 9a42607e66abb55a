"""The intent (DESIGN.md §1 step 6): in one transaction the CAS + fencing commit of
``intent.committed``, the action with its idempotency key and the outbox row, each written by the
service of the app that owns it."""

from __future__ import annotations

import logging
import uuid

from django.conf import settings
from django.db import connection

from apps.actions.digest import action_digest, idempotency_key
from apps.actions.models import Action, ActionStatus
from apps.actions.registry import ParamsInvalid, params_validate, tool_get
from apps.actions.services import action_create
from apps.agent.common import (
    REQUESTER_GONE,
    RUN_POOL,
    TOOLS_POOL,
    actor_of,
    has_ledger,
    invalidating,
    requester_gone,
)
from apps.approvals.models import ApprovalRequest
from apps.core import sql
from apps.outbox.direct import DirectSend, direct_attempt_open, direct_give_back
from apps.outbox.services import outbox_enqueue
from apps.tasks import reducer
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v3 as reducer_v3
from apps.tasks.reducer.v4 import COALESCED_REASON
from apps.tasks.store import refused_event_record, task_append_event, worker_identity
from apps.tickets.connectors import CONNECTORS
from apps.tickets.selectors import open_mirror_for_device

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
    intent event and the outbox row. The dispatcher is kicked on commit (unless the run delivers
    the row itself). Parameters that do not match the tool's schema, or a reused key, are refused
    before any row is written; parameters
    whose recomputed h(a) is not the approval's invalidate it (the task asks again).
    ``compensates``: the action whose effect this one compensates (``reducer/2``). Returns True
    when the agent should take another step now: the approval was invalidated, or the run claimed
    the outbox row to deliver it itself (``FAULTDESK["OUTBOX_DIRECT_DELIVERY"]``, an action whose
    ordering key is its own: :func:`direct_delivery_take`)."""
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
    if compensates is None and tool.name == "ticket.create":
        joined = ticket_being_created(task, connector)
        if joined is not None:
            # One ticket per fault: another report's ticket for this device is being created (or
            # just was): re-plan once it settled, to join it as a comment (reducer/4).
            task_append_event(task=task, event_type="intent.deferred", actor=actor_of(lease),
                              lease_generation=lease.generation,
                              payload={"action_id": str(joined.pk), "task_id": str(joined.task_id),
                                       "reason": f"{joined.tool} {joined.status} for device {task.device_id}",
                                       "priority": proposal["params"].get("priority")},
                              side_effects=invalidating(approval, COALESCED_REASON) if approval is not None else None)
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
    own_key = tool.object_scope != "ticket"  # a new ticket's row is alone in its ordering key
    ordering_key = f"{tool.name}:{key}" if own_key else f"ticket:{connector}:{params['ticket_id']}"
    # Direct delivery: this run delivers the row itself right after the intent's commit (see
    # :func:`direct_delivery_take`), when no other row can be ahead of it in its ordering key, and
    # only on the tools pool: waiting for a ticket system is a tool call's wait, never a model slot's.
    # A ticket system without idempotency (its key looked up before any resend) keeps the dispatcher's
    # one-row path too.
    direct = own_key and settings.FAULTDESK["OUTBOX_DIRECT_DELIVERY"] and RUN_POOL.get() == TOOLS_POOL \
        and CONNECTORS[connector].idempotent_by_key
    deliver_by = worker_identity() if direct else None

    written = []

    def write_action(t: Task, event) -> None:
        action = action_create(action_id=action_id, tenant_id=t.tenant_id, task_id=t.pk, tool=tool, connector=connector,
                               params=params, params_digest=digest, idempotency_key=key, approval=approval,
                               object_version=object_version, compensates=compensates)
        message = outbox_enqueue(action=action, ordering_key=ordering_key, deliver_by=deliver_by)
        if deliver_by is not None:
            written.append((action, message))

    task_append_event(
        task=task, event_type="intent.committed", actor=actor_of(lease), lease_generation=lease.generation,
        payload={"action_id": str(action_id), "idempotency_key": key, "digest": digest,
                 "reservation": tool.cost_units, "approval_required": approval is not None,
                 "approval_id": str(approval.pk) if approval else None,
                 "proposal": proposal if approval is None else None, "object_version": object_version,
                 "connector": connector},
        side_effects=write_action,
    )
    if not written:
        return False
    # Direct delivery: re-authorized and its attempt row written in this same transaction; the run
    # goes on to DISPATCHING at once and sends it after the commit (apps/agent/runner.py).
    action, message = written[0]
    send = direct_attempt_open(message=message, action=action, task=task, owner=deliver_by)
    if send is None:
        return False  # handed to the dispatcher in this transaction
    _DIRECT[(lease.task_id, lease.generation)] = send
    return True


#: the advisory-lock namespace of the per-device ticket creation (first of two int4 keys), "fd" + "1t"
_ONE_TICKET_NAMESPACE = 0x66643174
#: actions of another report that a new ticket for the same device waits for: in flight, or not yet known
IN_FLIGHT = (ActionStatus.INTENDED, ActionStatus.UNKNOWN)


def ticket_being_created(task: Task, connector: str) -> Action | None:
    """One ticket per fault (``reducer/4``'s ``coalesce``): the ``ticket.create`` of another task
    of the same tenant and device that this task's new ticket would duplicate — one still in flight
    (intended, or its outcome unknown), or one that created a ticket still open — or None.

    Only where a report can join a ticket as a comment (a ticket system with conditional writes)
    and for tasks whose reducer has the feature. Takes the device's advisory lock for the rest of
    the run's transaction: two reports' intents for one device are decided one after the other, so
    the second sees the first's action (committed with its intent) and defers instead of creating
    a second ticket. One or two statements."""
    if not reducer.supports((task.artifact_bundle or {}).get("reducer"), "coalesce") \
            or not CONNECTORS[connector].supports_conditional_writes:
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_ONE_TICKET_NAMESPACE, task.device_id])
    others = (Action.objects.for_tenant(task.tenant_id)
              .filter(tool="ticket.create", connector=connector, compensates__isnull=True,
                      task__device_id=task.device_id)
              .exclude(task_id=task.pk))
    pending = others.filter(status__in=IN_FLIGHT).order_by("created_at").first()
    if pending is not None:
        return pending
    # A ticket created and open joins as the context read would find it (open_ticket_read): not
    # one whose request is being taken back — re-planning behind that would only come back here.
    mirror = open_mirror_for_device(tenant_id=task.tenant_id, device_id=task.device_id, connector=connector)
    if mirror is None or mirror.action_id is None:
        return None
    return others.filter(pk=mirror.action_id).first()


def joined_ticket_pending(task: Task) -> bool:
    """Whether ``task`` deferred its new ticket behind another report's (``state["coalesce"]``,
    ``intent.deferred``) whose action is still in flight: the plan's reads wait until it settled
    (the lease sweeper brings the task back every ``SWEEPER_IDLE_SECONDS``). One statement when
    the task waits for one, none otherwise."""
    waiting = (task.state or {}).get("coalesce")
    if not waiting:
        return False
    status = Action.objects.for_tenant(task.tenant_id).filter(pk=waiting["action_id"]).values_list(
        "status", flat=True).first()
    return status in IN_FLIGHT


#: rows this process's runs claimed at their intents and have not delivered yet, by (task id, lease
#: generation): a run is one process's, and the generation keeps a later run from taking an earlier one's
_DIRECT: dict[tuple[uuid.UUID, int], DirectSend] = {}


def direct_delivery_take(lease: Lease) -> DirectSend | None:
    """The outbox row ``lease``'s run claimed at its intent (docs/architecture.md §6, direct
    delivery), with its attempt opened, taken off the list; or None. The row is delivered once its
    intent is committed; a row never taken (the run ended first) is handed to the dispatcher when
    the run ends (:func:`direct_deliveries_forget`)."""
    return _DIRECT.pop((lease.task_id, lease.generation), None)


def direct_deliveries_forget(lease: Lease) -> None:
    """``lease``'s run is over: a row it claimed at its intent and never sent (it ended first, e.g.
    at its step limit) goes to the dispatcher now, its attempt closed as not sent
    (:func:`~apps.outbox.direct.direct_give_back`), rather than waiting for its lease to expire.
    When that fails the lease's expiry still hands it over."""
    send = _DIRECT.pop((lease.task_id, lease.generation), None)
    if send is None:
        return
    try:
        direct_give_back(send, "the run ended before its request")
    except Exception:  # noqa: BLE001 - the row's lease expires and a dispatcher takes it over anyway
        log.exception("handing the outbox row %s back to the dispatcher failed", send.message.pk)
