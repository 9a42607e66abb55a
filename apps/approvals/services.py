"""Approval policy decisions, approval requests and decisions (DESIGN.md §7; spec §16.6).

An approval binds h(a), V_o, V_p, scope and expiry. :func:`approval_check_binding` is the
re-check run before committing the intent and again at the moment of dispatch.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.accounts.models import Role
from apps.accounts.principal import Principal, principal_current
from apps.actions.digest import action_digest as h_of_action
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.policy import policy_decide
from apps.approvals.rules import ROLES
from apps.core.errors import Conflict, Forbidden, NotFound, Unprocessable
from apps.core.queue import AGENT_STEP, enqueue_on_commit
from apps.tasks import reducer
from apps.tasks.store import refused_event_record
from apps.tickets.selectors import request_deadlines

log = logging.getLogger(__name__)


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
    if decision not in ("approve", "reject"):
        raise Unprocessable(_("decision must be 'approve' or 'reject'"))
    reason = (reason or "").strip()
    if decision == "reject" and not reason:
        raise Unprocessable(_("a rejection needs a reason"))
    if not principal.is_approver:
        raise Forbidden(_("only approvers may decide approvals"))
    try:
        return _decide(principal=principal, approval_id=approval_id, decision=decision, reason=reason)
    except _Refused as refused:
        # The decision rolled back; keep the record of what δ refused.
        # At the version δ refused it at: the task as read under the decision's lock, not as it is now.
        refused_event_record(task=refused.task, event_type=refused.event_type, payload=refused.payload,
                             reason=refused.reason, actor=principal.as_actor())
        # ``refused.reason`` is recorded (the refused event): it stays as recorded, in English.
        raise Conflict(_("the task no longer waits for this approval: %(reason)s")
                       % {"reason": refused.reason}) from None


def _roles_in_words(roles) -> str:
    """``("approver", "admin")`` as the reader names them: "Approver or Admin"."""
    return _(" or ").join(str(Role(r).label) if r in Role.values else r for r in roles)


class _Refused(Exception):
    def __init__(self, task, event_type: str, payload: dict, reason: str):
        super().__init__(reason)
        self.task, self.event_type, self.payload, self.reason = task, event_type, payload, reason


def _decide(*, principal: Principal, approval_id, decision: str, reason: str) -> ApprovalRequest:
    from apps.tasks.models import Task
    from apps.tasks.store import task_append_event

    with transaction.atomic():
        # Lock order: the task, then the approval — the order every task write with an approval
        # side effect uses (a cancel closes pending approvals after updating the task), so a
        # decision racing a cancel waits instead of deadlocking.
        task_id = (ApprovalRequest.objects.visible_to(principal).filter(pk=approval_id)
                   .values_list("task_id", flat=True).first())
        if task_id is None:
            raise NotFound(_("approval not found"))
        Task.objects.select_for_update().filter(pk=task_id).first()
        approval = ApprovalRequest.objects.visible_to(principal).select_for_update().filter(pk=approval_id).first()
        if approval is None:
            raise NotFound(_("approval not found"))
        if approval.requested_by_id == principal.user_id:
            raise Forbidden(_("you may not approve your own request"))
        if approval.approver_roles and principal.role not in approval.approver_roles:
            raise Forbidden(_("policy v%(version)s lets only %(roles)s decide this approval") % {
                "version": approval.policy_version, "roles": _roles_in_words(approval.approver_roles)})
        if approval.status == ApprovalStatus.PENDING:
            current = policy_decide(tenant_id=approval.tenant_id, tool=approval.tool)
            if current.policy_version != approval.policy_version and current.requires_approval \
                    and principal.role not in current.approver_roles:
                # The approval would not bind (approval_check_binding): refuse the decision now, while
                # it stays pending for someone the current policy lets decide.
                raise Forbidden(_("the approval policy changed since this was requested (v%(old)s → v%(new)s): "
                                  "only %(roles)s may decide it now") % {
                    "old": approval.policy_version, "new": current.policy_version,
                    "roles": _roles_in_words(current.approver_roles)})
        if approval.status != ApprovalStatus.PENDING:
            raise Conflict(
                _("approval is already %(status)s") % {"status": str(ApprovalStatus(approval.status).label).lower()},
                status=approval.status,
                decided_by=approval.decided_by.get_username() if approval.decided_by else None,
            )
        now = timezone.now()
        if approval.expires_at <= now:
            raise Conflict(_("approval has expired"), status=ApprovalStatus.EXPIRED)
        task = Task.objects.get(pk=approval.task_id)  # locked above
        shown_differs = decision == "approve" and not approval_shows_what_it_binds(approval)
        if shown_differs:
            # What the approver was shown is not what the approval binds: nobody approves that.
            # The approval is invalidated (and that is committed); the task asks again.
            approval_invalidate(approval=approval, reason=SHOWN_DIFFERS)
            event_type, payload = "approval.invalidated", {"approval_id": str(approval.pk), "reason": SHOWN_DIFFERS}
        else:
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
        enqueue_on_commit(AGENT_STEP, task.pk)
    if shown_differs:
        # SHOWN_DIFFERS is recorded (the approval's reason, the event's payload): it stays in English.
        raise Conflict(_("not approved: %(reason)s; the request will be asked again") % {"reason": SHOWN_DIFFERS},
                       status=ApprovalStatus.INVALIDATED)
    return approval


SHOWN_DIFFERS = "the parameters shown for approval differ from the ones it binds (h(a) recomputed)"


def approval_shows_what_it_binds(approval: ApprovalRequest) -> bool:
    """Whether the parameters an approver is shown (``approval.params``, with its tool and tool
    version) hash to the h(a) the approval binds (``approval.action_digest``): recomputed, so a
    changed parameter is caught even when the stored digest was left as it was."""
    return h_of_action(tool=approval.tool, tool_version=approval.tool_version,
                       params=approval.params) == approval.action_digest


PURGED = "the approval's copy of what it approved was purged under the retention policy; its h(a) stays"


@dataclass(frozen=True)
class BindingCheck:
    """The outcome of :func:`approval_check_binding`: ``ok``, else the first mismatch in
    ``reason``; ``purged`` when the approval's copies were emptied by retention (never ``ok``: a
    purged approval authorizes nothing more, and it is not a changed one either)."""

    ok: bool
    reason: str = ""
    purged: bool = False


def approval_check_binding(
    *, approval: ApprovalRequest, action_digest: str, object_version: int, now=None
) -> BindingCheck:
    """Re-check an approval against the action about to be executed (DESIGN.md §7, TOCTOU):
    approved, same h(a) — ``action_digest`` recomputed by the caller from the parameters to be
    sent, and the approval's own shown parameters re-hashed — same V_o, not expired, and the
    approver still holds an approver role in the tenant now. Returns a :class:`BindingCheck`
    whose ``reason`` names the first mismatch; an approval whose copies retention purged
    (``apps.approvals.retention``) is reported as ``purged``, not as showing other parameters."""
    now = now or timezone.now()
    if approval.status != ApprovalStatus.APPROVED:
        return BindingCheck(False, f"approval is {approval.status}")
    if approval.action_digest != action_digest:
        return BindingCheck(False, "parameters changed since approval (digest mismatch)")
    if approval.purged:
        return BindingCheck(False, PURGED, purged=True)
    if not approval_shows_what_it_binds(approval):
        return BindingCheck(False, SHOWN_DIFFERS)
    if approval.object_version != object_version:
        return BindingCheck(
            False, f"device version changed since approval ({approval.object_version} → {object_version})"
        )
    if approval.expires_at <= now:
        return BindingCheck(False, "approval expired")
    approver = principal_current(user_id=approval.decided_by_id, tenant_id=approval.tenant_id)
    allowed = approval.approver_roles or list(ROLES)
    if approver is None or not approver.is_approver or approver.role not in allowed:
        return BindingCheck(False, "approver no longer holds an approver role (or the account is deactivated)")
    current = policy_decide(tenant_id=approval.tenant_id, tool=approval.tool)
    if current.policy_version != approval.policy_version and current.requires_approval \
            and approver.role not in current.approver_roles:
        return BindingCheck(False, f"policy changed since approval (v{approval.policy_version} → "
                                   f"v{current.policy_version}): only {' or '.join(current.approver_roles)} may "
                                   f"approve {approval.tool} now")
    return BindingCheck(True)


@dataclass(frozen=True)
class BindingAudit:
    """What :func:`approval_binding_audit` found: ``state`` is ``"ok"`` (the copy re-hashes to h(a)
    and every action sent under the approval carries that h(a)), ``"purged"`` (the same, except
    the copy was emptied by retention: h(a) is checked against what was sent only), ``"unsent"``
    (nothing was sent under it; the copy re-hashes, or was purged) or ``"differs"``; ``reason``
    says why for anything but ``"ok"``."""

    state: str
    reason: str = ""


def approval_binding_audit(*, approval: ApprovalRequest) -> BindingAudit:
    """After the fact, compare what ``approval`` binds with what was sent under it (DESIGN.md §7,
    §12 invariant 2): each action row it authorized must carry its h(a) (``params_digest``), and
    that digest must be the hash of the parameters the row holds (what the ticket system got);
    the approval's own copy must re-hash to h(a) — unless retention purged it, which is reported as
    ``purged``, never as ``differs``. Reads the approval's action rows (one query). Returns a
    :class:`BindingAudit`."""
    from apps.actions.models import Action

    actions = list(Action.objects.filter(approval_id=approval.pk).order_by("created_at"))
    for action in actions:
        if action.params_digest != approval.action_digest:
            return BindingAudit("differs", f"action {action.pk} was sent with h(a) {action.params_digest[:12]}…, "
                                           f"the approval binds {approval.action_digest[:12]}…")
        sent = h_of_action(tool=action.tool, tool_version=action.tool_version, params=action.params)
        if sent != action.params_digest:
            return BindingAudit("differs", f"action {action.pk}: its parameters do not hash to its h(a)")
    sent_any = bool(actions)
    if approval.purged:
        return BindingAudit("purged", f"{PURGED} ({approval.purged}, {approval.purged_at:%Y-%m-%d})"
                            + ("" if sent_any else "; nothing was sent under it"))
    if not approval_shows_what_it_binds(approval):
        return BindingAudit("differs", SHOWN_DIFFERS)
    return BindingAudit("ok") if sent_any else BindingAudit("unsent", "nothing was sent under it")


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
    """Mark an approval invalid with ``reason`` (call inside the caller's transaction): its
    ``closed_reason``; also its ``reason`` unless a person decided it, whose own reason is kept."""
    rows = ApprovalRequest.objects.filter(pk=approval.pk)
    reason = reason[:2000]
    rows.filter(decided_by__isnull=True).update(status=ApprovalStatus.INVALIDATED, reason=reason, closed_reason=reason)
    rows.filter(decided_by__isnull=False).update(status=ApprovalStatus.INVALIDATED, closed_reason=reason)


def approval_request_create(*, approval_id: uuid.UUID, task, requested_by_id: int, proposal: dict, decision,
                            object_type: str, object_id: str, object_version: int, scope: str, side_effects: str,
                            evidence: list[dict], expires_at, decided: dict | None = None) -> ApprovalRequest:
    """Create the approval request ``approval_id`` for ``task``'s ``proposal`` (``{tool,
    tool_version, params, digest}``) under ``decision`` (a :class:`~apps.approvals.policy.PolicyDecision`:
    its V_p and who may decide), binding h(a), the object and its version V_o, ``scope`` and
    ``expires_at`` (DESIGN.md §7). ``side_effects`` is the sentence the approver reads; ``evidence``
    the cited refs shown with it. ``decided`` (``status``, ``decided_by_id``, ``decided_at``,
    ``reason``) records an approval carried over, granted already. Call inside the transaction
    of the task event that asks for it. The row carries the request's respond-by due date
    (:func:`respond_by`), by which the pending queue is ordered."""
    return ApprovalRequest.objects.create(
        id=approval_id, tenant_id=task.tenant_id, task_id=task.pk, requested_by_id=requested_by_id,
        tool=proposal["tool"], tool_version=proposal["tool_version"], params=proposal["params"],
        action_digest=proposal["digest"], object_type=object_type, object_id=object_id, object_version=object_version,
        policy_version=decision.policy_version, approver_roles=list(decision.approver_roles), scope=scope,
        side_effects=side_effects, evidence=evidence, expires_at=expires_at,
        respond_by=respond_by(task, proposal), **(decided or {}),
    )


def respond_by(task, proposal: dict | None):
    """When ``task`` must be answered under its tenant's service levels (apps/tickets/sla.py),
    counted from its filing, at the priority of ``proposal`` (else its urgency's); None when the
    tenant's SLA policy cannot give a date (logged, never a refused approval). One query."""
    if (proposal or {}).get("tool") not in ("ticket.create", "ticket.comment"):
        return None  # a compensation: its request was cancelled, no answer is due
    due = request_deadlines(tenant_id=task.tenant_id, created_at=task.created_at,
                            state={**(task.state or {}), "proposal": proposal}, urgency=task.urgency)
    if due is None:
        log.warning("tenant %s: no respond-by date for task %s (its SLA policy cannot give one)",
                    task.tenant_id, task.pk)
        return None
    return due.respond_by


def pending_respond_by_refresh(*, tenant_id: int) -> int:
    """Recompute the respond-by date of ``tenant_id``'s pending approvals under its service levels
    as they are now (after its SLA policy was saved or deleted), so the queue's order and the time
    left follow the policy the requester's page shows. Returns how many rows changed; two queries
    and one bulk update."""
    pending = list(ApprovalRequest.objects.for_tenant(tenant_id).filter(status=ApprovalStatus.PENDING)
                   .select_related("task"))
    changed = []
    for approval in pending:
        due = respond_by(approval.task, {"tool": approval.tool, "params": approval.params})
        if due != approval.respond_by:
            approval.respond_by = due
            changed.append(approval)
    ApprovalRequest.objects.bulk_update(changed, ["respond_by"], batch_size=500)
    return len(changed)
