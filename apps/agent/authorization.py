"""Authorization (DESIGN.md §7; spec §16.6): validate the draft, decide by policy whether a person
must approve, ask for the approval, and re-check its binding and premises when it is granted."""

from __future__ import annotations

import dataclasses
import logging
import uuid

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.accounts.principal import principal_current
from apps.actions.digest import proposal_digest
from apps.actions.registry import tool_get
from apps.agent.common import (
    REQUESTER_GONE,
    actor_of,
    closing_held,
    fail,
    invalidating,
    keeps_plans,
    plans_comments,
)
from apps.agent.drafting import plan
from apps.agent.intent import commit_intent, write_short
from apps.agent.plans import evidence_changed, plan_activate, premises_moved
from apps.approvals.models import ApprovalRequest
from apps.approvals.policy import policy_decide
from apps.approvals.services import approval_check_binding_now, approval_invalidate, approval_request_create
from apps.evidence.selectors import chunk_readable
from apps.llm.parser import draft_validate
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v2 as reducer_v2
from apps.tasks.reducer import v6 as reducer_v6
from apps.tasks.store import task_append_event
from apps.tickets.connectors import CONNECTORS

log = logging.getLogger(__name__)


def premises_changed(task: Task) -> str | None:
    """Re-check what the plan assumed before resuming it: the requester still
    belongs to the tenant and may still read every cited chunk. Returns what changed, or None."""

    requester = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    if requester is None or not requester.is_requester:
        return "requester_revoked"
    for ref in task.state.get("evidence") or []:
        if chunk_readable(chunk_id=ref["chunk_id"], tenant_id=task.tenant_id, scopes=requester.scopes) is None:
            return "requester's permissions changed: cited evidence no longer readable"
    return None


def validate_and_authorize(task: Task, lease: Lease) -> bool:
    state, gen, actor = task.state, lease.generation, actor_of(lease)
    draft, device = state["draft"], state["device"]
    problems = draft_validate(
        draft=draft, evidence_ids={str(r["chunk_id"]) for r in state["evidence"] or []},
        device_asset_tag=device["asset_tag"], tenant=task.tenant.slug,
    )
    if problems:
        if not state["evidence"]:
            task_append_event(task=task, event_type="task.failed", actor=actor, lease_generation=gen,
                              payload={"reason": "no readable evidence for this device and symptom"})
            return False
        task_append_event(task=task, event_type="draft.invalid", actor=actor, lease_generation=gen,
                          payload={"problems": problems})
        return True
    if draft["missing_information"]:
        task_append_event(task=task, event_type="input.requested", actor=actor, lease_generation=gen,
                          payload={"questions": draft["missing_information"]},
                          side_effects=closing_held(task, "input.requested"))
        return False
    proposal = plan(state, draft)
    tool = tool_get(proposal["tool"])
    if short := write_short(task, tool):
        fail(task, lease, short)
        return False
    held = state.get("revalidating")
    if held is not None and proposal_digest(proposal) == held["digest"]:
        # the evidence behind the approval changed, the re-drafted action did not: the approval stands
        task_append_event(task=task, event_type="approval.revalidated", actor=actor, lease_generation=gen,
                          payload={"approval_id": held["approval_id"], "proposal": proposal, "why": held["why"]})
        return True
    params = proposal["params"]
    ticket = state.get("ticket") if tool.object_scope == "ticket" else None
    object_version = ticket["version"] if ticket else device["version"]
    selection = state.get("selection") or {}
    decision = policy_decide(tenant_id=task.tenant_id, tool=tool.name, evidence=state["evidence"] or [],
                             no_procedure=selection.get("reason", "") if selection.get("outcome") == "no_procedure"
                             else "")
    if held is not None:
        # the changed evidence changed the approved action: a person approves the new one
        decision = dataclasses.replace(decision, requires_approval=True, forced_by=decision.forced_by or (
            "the evidence behind the earlier approval changed, and with it the action"))
    if decision.requires_approval:
        approval_id = uuid.uuid4()
        expires_at = timezone.now() + decision.ttl
        system = CONNECTORS[task.tenant.ticket_system].label
        if ticket:
            target = {"object_type": "ticket", "object_id": ticket["external_id"]}
            scope = f"{task.tenant.slug}:{tool.name}:ticket/{ticket['external_id']}"
            effects = (f"Adds one comment to ticket {ticket['external_id']} in {system}, only while the ticket is "
                       f"still at version {ticket['version']} (If-Match); no new ticket.")
        else:
            target = {"object_type": "device", "object_id": str(device["device_id"])}
            scope = f"{task.tenant.slug}:{tool.name}:device/{device['asset_tag']}"
            effects = f"Creates one ticket in {system} for {device['asset_tag']} with priority {params['priority']}."
        if decision.forced_by:
            effects += f" A person must approve: {decision.forced_by}."

        carried = _carried_over(task, proposal, decision)
        decided = {}
        if carried is not None:
            # The same low-risk write, approved before in this task; only the ticket's version moved.
            decided = {"status": "APPROVED", "decided_by_id": carried.decided_by_id, "decided_at": timezone.now(),
                       "reason": f"carried over from approval {carried.pk}: the same low-risk {tool.name}, only the "
                                 f"ticket version moved ({carried.object_version} → {object_version})"}
            expires_at = carried.expires_at

        def create_approval(t: Task, event) -> None:
            if held is not None and (old := ApprovalRequest.objects.for_tenant(t.tenant_id)
                                     .filter(pk=held["approval_id"]).first()) is not None:
                approval_invalidate(approval=old, reason=reducer_v6.changed_proposal_reason(state))
            approval_request_create(approval_id=approval_id, task=t, requested_by_id=t.requester_id, proposal=proposal,
                                    decision=decision, object_version=object_version, scope=scope,
                                    side_effects=effects, evidence=state["evidence"], expires_at=expires_at,
                                    decided=decided, **target)

        payload = {"approval_id": str(approval_id), "proposal": proposal, "object_version": object_version,
                   "policy_version": decision.policy_version, "expires_at": expires_at.isoformat()}
        if decision.forced_by:
            payload["forced_by"] = decision.forced_by
        if carried is not None:
            payload.update(carried_over_from=str(carried.pk), decided_by=carried.decided_by.get_username())
        task_append_event(task=task, event_type="approval.requested", actor=actor, lease_generation=gen,
                          payload=payload, side_effects=create_approval)
        return carried is not None  # a carried-over approval is granted: commit the intent next
    return commit_intent(task, lease, proposal=proposal, approval=None, object_version=object_version)


def _carried_over(task: Task, proposal: dict, decision) -> ApprovalRequest | None:
    """The approval a re-planned write may carry over instead of asking again (DESIGN.md §7: an
    unchanged, already-authorized low-risk action is not sent for approval twice), or None.

    Only under ``reducer/2``, for a tool the policy rates low-risk, after the task's previous
    approval was granted and then invalidated by a conflict (412: the ticket moved on). The new
    proposal must be the same tool on the same ticket with the same parameters except
    ``if_match``, under the same policy version; the old approval must be unexpired and its
    approver must still hold an allowed role."""

    previous = task.state.get("approval")
    if not (plans_comments(task) and decision.risk == "low" and previous and previous["status"] == "INVALIDATED"
            and previous.get("reason") == reducer_v2.CONFLICT_REASON):
        return None
    old = (ApprovalRequest.objects.for_tenant(task.tenant_id).select_related("decided_by")
           .filter(pk=previous["id"], decided_by__isnull=False).first())
    if old is None or old.tool != proposal["tool"] or old.policy_version != decision.policy_version:
        return None

    def material(params: dict) -> dict:
        return {k: v for k, v in params.items() if k != "if_match"}

    if material(old.params) != material(proposal["params"]) or old.expires_at <= timezone.now():
        return None
    approver = principal_current(user_id=old.decided_by_id, tenant_id=task.tenant_id)
    if approver is None or approver.role not in (old.approver_roles or ("approver", "admin")):
        return None
    return old


def resume_after_approval(task: Task, lease: Lease) -> bool:
    """WAITING_APPROVAL: when the approval is granted, re-check the premises and commit the intent
    only if they all hold: the requester and the evidence's readability (else the approval is
    invalidated, or the task fails when the requester is gone); under ``reducer/6`` the evidence's
    versions (superseded or retired evidence re-plans with the approval held for re-validation);
    the binding — h(a), device version, expiry, approver's role, policy — (else invalidated and
    re-planned); then, under ``reducer/6``, every other premise of the current plan version
    (:func:`apps.agent.plans.premises_moved`: any that moved re-plans behind a barrier with the
    approval held, as for evidence). Returns True when another step follows now."""
    state, gen, actor = task.state, lease.generation, actor_of(lease)
    approval, moved = approval_granted(task, lease, state["approval"])
    if approval is None:
        return moved
    a = state["approval"]
    changed = premises_changed(task)
    if changed == "requester_revoked":
        task_append_event(task=task, event_type="task.failed", actor=actor, lease_generation=gen,
                          payload={"reason": REQUESTER_GONE})
        return False
    if changed:
        task_append_event(task=task, event_type="approval.invalidated", actor=actor, lease_generation=gen,
                          payload={"approval_id": a["id"], "reason": changed},
                          side_effects=invalidating(approval, changed))
        return True
    if keeps_plans(task) and (moved := evidence_changed(task)):
        # superseded or retired evidence: re-plan (the reads whose premises hold continue), re-draft,
        # and keep this approval only if the action comes out the same
        plan_activate(task, lease, why=moved)
        return True
    if invalidated_unless_bound(task, lease, approval, proposal_digest(state["proposal"])):
        return True
    if keeps_plans(task) and (drifted := premises_moved(task)):
        # a premise of the plan moved while the task waited (the requester's scopes or role, the
        # device, the policy...): re-plan behind a barrier with this approval held — the reads that
        # depend on it are read again, the draft is made again, and the approval stands only if the
        # action comes out the same (approval.revalidated); otherwise the approver is asked again
        plan_activate(task, lease, why=f"premises changed while the task waited for its approval: "
                                        f"{', '.join(drifted)}")
        return True
    return commit_intent(task, lease, proposal=state["proposal"], approval=approval,
                          object_version=approval.object_version)


def approval_granted(task: Task, lease: Lease, a: dict) -> tuple[ApprovalRequest | None, bool]:
    """The state's approval ``a`` (the task's or its compensation's): ``(row, False)`` when it is
    granted and the caller re-checks it; ``(None, True)`` after recording that it expired
    undecided (the next step re-plans); ``(None, False)`` while it is pending, rejected or gone."""
    approval = ApprovalRequest.objects.for_tenant(task.tenant_id).filter(pk=a["id"]).first()
    if approval is None:
        return None, False
    if a["status"] == "PENDING":
        expires = parse_datetime(a["expires_at"])
        if expires is not None and expires <= timezone.now() and approval.status == "PENDING":
            # The approval row changes in the event's own transaction, so a refused event
            # (lease lost) is still recorded and the row is left as it was.
            task_append_event(task=task, event_type="approval.invalidated", actor=actor_of(lease),
                              lease_generation=lease.generation, payload={"approval_id": a["id"], "reason": "expired"},
                              side_effects=invalidating(approval, "approval expired before a decision"))
            return None, True
        return None, False
    return (approval, False) if a["status"] == "APPROVED" else (None, False)


def invalidated_unless_bound(task: Task, lease: Lease, approval: ApprovalRequest, digest: str) -> bool:
    """Re-check a granted approval's binding now (h(a), object version, expiry, the approver's
    role); when it no longer holds, record ``approval.invalidated`` with the reason and return True.
    ``digest`` is h(a) recomputed from the parameters about to be committed
    (:func:`~apps.actions.digest.proposal_digest`), never a stored digest."""
    check = approval_check_binding_now(approval=approval, action_digest=digest)
    if check.ok:
        return False
    task_append_event(task=task, event_type="approval.invalidated", actor=actor_of(lease),
                      lease_generation=lease.generation,
                      payload={"approval_id": str(approval.pk), "reason": check.reason},
                      side_effects=invalidating(approval, check.reason))
    return True
