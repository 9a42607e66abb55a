"""The tenant's approval policy, decided per tool (DESIGN.md §7; spec §16.6 "审批策略"): whether a
write needs a person, for how long, and who may decide, under the policy's version V_p."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from apps.actions.registry import TOOLS
from apps.approvals.models import ApprovalPolicy
from apps.approvals.rules import DEFAULT_RULES, ROLES, policy_rule
from apps.core import sql


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
    policy = sql.row(ApprovalPolicy, "t0.active", [], tenant_id=tenant_id, tail="ORDER BY t0.version DESC LIMIT 1")
    if policy is None:
        policy, _ = ApprovalPolicy.objects.get_or_create(
            tenant_id=tenant_id, version=1, defaults={"rules": DEFAULT_RULES, "active": True}
        )
    return policy


def policy_decide(*, tenant_id: int, tool: str, evidence: list[dict] = (), no_procedure: str = "") -> PolicyDecision:
    """Decide whether ``tool`` needs a human approval in ``tenant_id``, for how long and from whom
    (DESIGN.md §7; spec §16.6). Unknown tools and risk levels need an approval. So does an action
    that cites evidence marked ``requires_human_gate`` (the documentation projection's human gate)
    or that is proposed without a procedure (``no_procedure``: why none covers the report),
    whatever the policy's rule says; ``forced_by`` records which."""

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
