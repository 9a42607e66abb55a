"""Approval policy decisions, approval requests and decisions (DESIGN.md §7; spec §16.6).

An approval binds h(a), V_o, V_p, scope and expiry. :func:`approval_check_binding` is the
re-check run before committing the intent and again at the moment of dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from apps.accounts.api import Conflict, Forbidden, NotFound, Unprocessable
from apps.accounts.principal import Principal, principal_current
from apps.approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from apps.tasks import reducer

DEFAULT_RULES = {
    "ticket.create": {"requires_approval": True, "ttl_minutes": 240},
    "ticket.comment": {"requires_approval": True, "ttl_minutes": 240},
    # A compensation always needs its own approval, whatever the rule says (DESIGN.md §6).
    "ticket.update": {"requires_approval": True, "ttl_minutes": 240},
}


@dataclass(frozen=True)
class PolicyDecision:
    """What the policy says about one tool: approval needed?, for how long, under version V_p."""

    requires_approval: bool
    ttl: timedelta
    policy_version: int


def policy_current(*, tenant_id: int) -> ApprovalPolicy:
    """The tenant's active policy with the highest version; creates version 1 with
    :data:`DEFAULT_RULES` when the tenant has none."""
    policy = ApprovalPolicy.objects.filter(tenant_id=tenant_id, active=True).order_by("-version").first()
    if policy is None:
        policy, _ = ApprovalPolicy.objects.get_or_create(
            tenant_id=tenant_id, version=1, defaults={"rules": DEFAULT_RULES, "active": True}
        )
    return policy


def policy_decide(*, tenant_id: int, tool: str) -> PolicyDecision:
    """Decide whether ``tool`` needs a human approval in ``tenant_id``. Unknown tools need one."""
    policy = policy_current(tenant_id=tenant_id)
    rule = policy.rules.get(tool, {"requires_approval": True, "ttl_minutes": 60})
    return PolicyDecision(
        requires_approval=bool(rule.get("requires_approval", True)),
        ttl=timedelta(minutes=int(rule.get("ttl_minutes", 60))),
        policy_version=policy.version,
    )


def approval_decide(*, principal: Principal, approval_id, decision: str, reason: str = "") -> ApprovalRequest:
    """Approve or reject a pending approval as ``principal`` (an approver of the same tenant who
    did not file the request).

    Exactly one concurrent decision takes effect: the row is locked, and a decision on an approval
    that is no longer pending raises ``Conflict`` carrying the current decision. On success the
    task gets ``approval.granted`` / ``approval.rejected`` in the same transaction and the agent
    step is enqueued on commit.

    Raises ``NotFound``, ``Forbidden``, ``Unprocessable`` (bad decision / missing reject reason),
    ``Conflict``.
    """
    from apps.tasks.services import refused_event_record

    if decision not in ("approve", "reject"):
        raise Unprocessable("decision must be 'approve' or 'reject'")
    reason = (reason or "").strip()
    if decision == "reject" and not reason:
        raise Unprocessable("a rejection needs a reason")
    if not principal.is_approver:
        raise Forbidden("only approvers may decide approvals")
    try:
        return _decide(principal=principal, approval_id=approval_id, decision=decision, reason=reason)
    except _Refused as refused:
        # The decision rolled back; keep the record of what δ refused.
        refused_event_record(task=refused.task, event_type=refused.event_type, payload=refused.payload,
                             reason=refused.reason, actor=principal.as_actor())
        raise Conflict(f"the task no longer waits for this approval: {refused.reason}") from None


class _Refused(Exception):
    def __init__(self, task, event_type: str, payload: dict, reason: str):
        super().__init__(reason)
        self.task, self.event_type, self.payload, self.reason = task, event_type, payload, reason


def _decide(*, principal: Principal, approval_id, decision: str, reason: str) -> ApprovalRequest:
    from apps.tasks.models import Task
    from apps.tasks.services import task_append_event
    from apps.tasks.tasks import enqueue_agent_step

    with transaction.atomic():
        approval = (
            ApprovalRequest.objects.select_for_update()
            .filter(pk=approval_id, tenant_id=principal.tenant_id)
            .first()
        )
        if approval is None:
            raise NotFound("approval not found")
        if approval.requested_by_id == principal.user_id:
            raise Forbidden("you may not approve your own request")
        if approval.status != ApprovalStatus.PENDING:
            raise Conflict(
                f"approval is already {approval.status}",
                status=approval.status,
                decided_by=approval.decided_by.get_username() if approval.decided_by else None,
            )
        now = timezone.now()
        if approval.expires_at <= now:
            raise Conflict("approval has expired", status=ApprovalStatus.EXPIRED)
        task = Task.objects.select_for_update().get(pk=approval.task_id)
        approval.status = ApprovalStatus.APPROVED if decision == "approve" else ApprovalStatus.REJECTED
        approval.decided_by_id = principal.user_id
        approval.decided_at = now
        approval.reason = reason[:2000]
        approval.save(update_fields=["status", "decided_by", "decided_at", "reason"])
        event_type = "approval.granted" if decision == "approve" else "approval.rejected"
        payload = {"approval_id": str(approval.pk), "decided_by": principal.username, "reason": reason[:500]}
        try:
            task_append_event(task=task, event_type=event_type, payload=payload, actor=principal.as_actor())
        except reducer.IllegalTransition as exc:
            raise _Refused(task, event_type, payload, exc.reason) from exc
        enqueue_agent_step(task.pk)
    return approval


@dataclass(frozen=True)
class BindingCheck:
    ok: bool
    reason: str = ""


def approval_check_binding(
    *, approval: ApprovalRequest, action_digest: str, object_version: int, now=None
) -> BindingCheck:
    """Re-check an approval against the action about to be executed (DESIGN.md §7, TOCTOU):
    approved, same h(a), same V_o, not expired, and the approver still holds an approver role in
    the tenant now. Returns a :class:`BindingCheck` whose ``reason`` names the first mismatch."""
    now = now or timezone.now()
    if approval.status != ApprovalStatus.APPROVED:
        return BindingCheck(False, f"approval is {approval.status}")
    if approval.action_digest != action_digest:
        return BindingCheck(False, "parameters changed since approval (digest mismatch)")
    if approval.object_version != object_version:
        return BindingCheck(
            False, f"device version changed since approval ({approval.object_version} → {object_version})"
        )
    if approval.expires_at <= now:
        return BindingCheck(False, "approval expired")
    approver = principal_current(user_id=approval.decided_by_id, tenant_id=approval.tenant_id)
    if approver is None or not approver.is_approver:
        return BindingCheck(False, "approver no longer holds an approver role")
    return BindingCheck(True)


def approval_check_binding_now(*, approval: ApprovalRequest, action_digest: str, now=None) -> BindingCheck:
    """:func:`approval_check_binding` against the object as it is now. A device approval reads
    the device's current version V_o. A ticket approval (a comment, an update, a compensation)
    binds the ticket version the write is conditional on: the ticket system checks it atomically
    with ``If-Match`` when the write arrives (a 412 re-plans), so here it is taken as bound."""
    from apps.devices.selectors import device_read

    if approval.object_type == "device":
        current = device_read(tenant_id=approval.tenant_id, device_id=int(approval.object_id))
        version = current["version"] if current else -1
    else:
        version = approval.object_version
    return approval_check_binding(approval=approval, action_digest=action_digest, object_version=version, now=now)


def approval_invalidate(*, approval: ApprovalRequest, reason: str) -> None:
    """Mark an approval invalid with ``reason`` (call inside the caller's transaction)."""
    ApprovalRequest.objects.filter(pk=approval.pk).update(status=ApprovalStatus.INVALIDATED, reason=reason[:2000])
