"""The shape of an approval policy's rules and how a rule is chosen (DESIGN.md §7; spec §16.6):
pure data and checks, imported by the policy model to validate itself."""

from __future__ import annotations

import jsonschema

from apps.actions.registry import TOOLS

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


def policy_rule(rules: dict, tool: str, risk: str) -> dict:
    """The rule for ``tool`` (of risk level ``risk``) in ``rules``: the tool's own rule over the
    risk level's over :data:`FALLBACK_RULE`, field by field."""
    tools = rules["tools"] if "tools" in rules else rules
    by_risk = rules.get("risk", {}) if "tools" in rules else {}
    return {**FALLBACK_RULE, **by_risk.get(risk, {}), **tools.get(tool, {})}
