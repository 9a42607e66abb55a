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
from apps.actions.digest import action_digest as h_of_action
from apps.approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from apps.tasks import reducer

ROLES = ("approver", "admin")

#: The policy a tenant starts with (version 1). ``risk`` gives the rule for each risk level of the
#: tool contracts (apps.actions.registry); ``tools`` overrides it per tool. A rule is
#: ``{"requires_approval": bool, "ttl_minutes": int, "approver_roles": ["approver", "admin"]}``.
DEFAULT_RULES = {
    "risk": {
        "low": {"requires_approval": True, "ttl_minutes": 240, "approver_roles": ["approver", "admin"]},
        "medium": {"requires_approval": True, "ttl_minutes": 240, "approver_roles": ["approver", "admin"]},
        "high": {"requires_approval": True, "ttl_minutes": 60, "approver_roles": ["admin"]},
    },
    "tools": {
        "ticket.create": {"requires_approval": True, "ttl_minutes": 240},
        "ticket.comment": {"requires_approval": True, "ttl_minutes": 240},
        # A compensation always needs its own approval, whatever the rule says (DESIGN.md §6).
        "ticket.update": {"requires_approval": True, "ttl_minutes": 240},
    },
}

#: Used for a tool and risk level the policy does not mention: ask, for an hour, approvers or admins.
FALLBACK_RULE = {"requires_approval": True, "ttl_minutes": 60, "approver_roles": list(ROLES)}

_RULE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "requires_approval": {"type": "boolean"},
        "ttl_minutes": {"type": "integer", "minimum": 1, "maximum": 60 * 24 * 30},
        "approver_roles": {"type": "array", "items": {"enum": list(ROLES)}, "minItems": 1, "uniqueItems": True},
    },
}
#: The shape of ``ApprovalPolicy.rules``: ``{"risk": {level: rule}, "tools": {tool: rule}}``.
POLICY_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["tools"],
    "properties": {"risk": {"type": "object", "additionalProperties": False,
                            "properties": {lvl: _RULE_SCHEMA for lvl in ("low", "medium", "high")}},
                   "tools": {"type": "object", "additionalProperties": _RULE_SCHEMA}},
}
#: The older flat shape ``{tool: rule}``, still read.
FLAT_POLICY_SCHEMA = {"type": "object", "additionalProperties": _RULE_SCHEMA}


def policy_rules_validate(rules) -> list[str]:
    """Problems with a policy's ``rules`` (empty when valid), each naming the field: shape, rule
    fields, roles, TTL bounds."""
    import jsonschema

    from apps.actions.registry import TOOLS

    structured = isinstance(rules, dict) and ("tools" in rules or "risk" in rules)
    schema = POLICY_SCHEMA if structured else FLAT_POLICY_SCHEMA
    problems = [f"{'/'.join(map(str, e.absolute_path)) or '(rules)'}: {e.message}"
                for e in jsonschema.Draft202012Validator(schema).iter_errors(rules)]
    if isinstance(rules, dict):
        tools = rules.get("tools") if structured else rules
        if isinstance(tools, dict):
            problems += [f"{'tools/' if structured else ''}{name}: no such tool (known: {', '.join(sorted(TOOLS))})"
                         for name in tools if name not in TOOLS]
    return problems


@dataclass(frozen=True)
class PolicyDecision:
    """What the policy says about one tool: approval needed?, for how long, who may decide, the
    tool's risk level, under version V_p."""

    requires_approval: bool
    ttl: timedelta
    policy_version: int
    approver_roles: tuple[str, ...] = ROLES
    risk: str = "medium"
    #: why a person must approve whatever the policy says (cited evidence with a human gate, or no
    #: procedure covering the report); "" when the policy alone decided
    forced_by: str = ""


def policy_current(*, tenant_id: int) -> ApprovalPolicy:
    """The tenant's active policy with the highest version; creates version 1 with
    :data:`DEFAULT_RULES` when the tenant has none."""
    policy = ApprovalPolicy.objects.filter(tenant_id=tenant_id, active=True).order_by("-version").first()
    if policy is None:
        policy, _ = ApprovalPolicy.objects.get_or_create(
            tenant_id=tenant_id, version=1, defaults={"rules": DEFAULT_RULES, "active": True}
        )
    return policy


def policy_rule(rules: dict, tool: str, risk: str) -> dict:
    """The rule for ``tool`` (of risk level ``risk``) in ``rules``: the tool's own rule over the
    risk level's over :data:`FALLBACK_RULE`, field by field."""
    tools = rules["tools"] if "tools" in rules else rules
    by_risk = rules.get("risk", {}) if "tools" in rules else {}
    return {**FALLBACK_RULE, **by_risk.get(risk, {}), **tools.get(tool, {})}


def policy_decide(*, tenant_id: int, tool: str, evidence: list[dict] = (), no_procedure: str = "") -> PolicyDecision:
    """Decide whether ``tool`` needs a human approval in ``tenant_id``, for how long and from whom
    (DESIGN.md §7; spec §16.6). Unknown tools and risk levels need an approval. So does an action
    that cites evidence marked ``requires_human_gate`` (the documentation projection's human gate)
    or that is proposed without a procedure (``no_procedure``: why none covers the report),
    whatever the policy's rule says; ``forced_by`` records which."""
    from apps.actions.registry import TOOLS

    policy = policy_current(tenant_id=tenant_id)
    risk = TOOLS[tool].risk if tool in TOOLS else "high"
    rule = policy_rule(policy.rules, tool, risk)
    gated = next((ref for ref in evidence if ref.get("requires_human_gate")), None)
    forced = (f"the cited procedure {gated.get('document_title') or gated.get('source')} v{gated.get('version')} "
              "requires a person's approval") if gated else \
        (f"proposed without a procedure: {no_procedure}" if no_procedure else "")
    return PolicyDecision(
        forced_by=forced,
        requires_approval=bool(rule["requires_approval"]) or bool(forced),
        ttl=timedelta(minutes=int(rule["ttl_minutes"])),
        policy_version=policy.version,
        approver_roles=tuple(rule["approver_roles"]),
        risk=risk,
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
        # Lock order: the task, then the approval — the order every task write with an approval
        # side effect uses (a cancel closes pending approvals after updating the task), so a
        # decision racing a cancel waits instead of deadlocking.
        task_id = (ApprovalRequest.objects.visible_to(principal).filter(pk=approval_id)
                   .values_list("task_id", flat=True).first())
        if task_id is None:
            raise NotFound("approval not found")
        Task.objects.select_for_update().filter(pk=task_id).first()
        approval = ApprovalRequest.objects.visible_to(principal).select_for_update().filter(pk=approval_id).first()
        if approval is None:
            raise NotFound("approval not found")
        if approval.requested_by_id == principal.user_id:
            raise Forbidden("you may not approve your own request")
        if approval.approver_roles and principal.role not in approval.approver_roles:
            raise Forbidden(f"policy v{approval.policy_version} lets only {' or '.join(approval.approver_roles)} "
                            f"decide this approval")
        if approval.status != ApprovalStatus.PENDING:
            raise Conflict(
                f"approval is already {approval.status}",
                status=approval.status,
                decided_by=approval.decided_by.get_username() if approval.decided_by else None,
            )
        now = timezone.now()
        if approval.expires_at <= now:
            raise Conflict("approval has expired", status=ApprovalStatus.EXPIRED)
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
        enqueue_agent_step(task.pk)
    if shown_differs:
        raise Conflict(f"not approved: {SHOWN_DIFFERS}; the request will be asked again",
                       status=ApprovalStatus.INVALIDATED)
    return approval


SHOWN_DIFFERS = "the parameters shown for approval differ from the ones it binds (h(a) recomputed)"


def approval_shows_what_it_binds(approval: ApprovalRequest) -> bool:
    """Whether the parameters an approver is shown (``approval.params``, with its tool and tool
    version) hash to the h(a) the approval binds (``approval.action_digest``): recomputed, so a
    changed parameter is caught even when the stored digest was left as it was."""
    return h_of_action(tool=approval.tool, tool_version=approval.tool_version,
                       params=approval.params) == approval.action_digest


@dataclass(frozen=True)
class BindingCheck:
    ok: bool
    reason: str = ""


def approval_check_binding(
    *, approval: ApprovalRequest, action_digest: str, object_version: int, now=None
) -> BindingCheck:
    """Re-check an approval against the action about to be executed (DESIGN.md §7, TOCTOU):
    approved, same h(a) — ``action_digest`` recomputed by the caller from the parameters to be
    sent, and the approval's own shown parameters re-hashed — same V_o, not expired, and the
    approver still holds an approver role in the tenant now. Returns a :class:`BindingCheck`
    whose ``reason`` names the first mismatch."""
    now = now or timezone.now()
    if approval.status != ApprovalStatus.APPROVED:
        return BindingCheck(False, f"approval is {approval.status}")
    if approval.action_digest != action_digest:
        return BindingCheck(False, "parameters changed since approval (digest mismatch)")
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
