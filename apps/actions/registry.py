"""The tool registry: one contract per tool (DESIGN.md §6; spec §16.1: read/write, object scope,
preconditions, deadline, retry class, idempotency support, result lookup, parameter schema)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolContract:
    name: str
    version: str
    kind: str  # "read" | "write"
    object_scope: str  # what it touches, e.g. "device" or "ticket"
    preconditions: tuple[str, ...]
    deadline_seconds: float
    retry_class: str  # "none" | "retry_same_key" | "lookup_then_retry"
    idempotent_by_key: bool
    result_lookup: str | None  # how to find the outcome of an unknown attempt
    cost_units: int  # budget reservation r for one call
    risk: str  # "low" | "medium" | "high"
    params_schema: dict = field(default_factory=dict)
    #: sent with ``If-Match: <the ticket version it was planned on>``; a 412 re-reads and re-plans
    conditional: bool = False


TICKET_CREATE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "description", "priority", "device", "tenant", "requester", "labels", "evidence"],
    "properties": {
        "title": {"type": "string", "minLength": 5, "maxLength": 200},
        "description": {"type": "string", "minLength": 10, "maxLength": 8000},
        "priority": {"enum": ["P1", "P2", "P3", "P4"]},
        "device": {"type": "string", "minLength": 1, "maxLength": 64},
        "tenant": {"type": "string", "minLength": 1},
        "requester": {"type": "string", "minLength": 1},
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        # Empty when no readable procedure covers the report (the draft says so); the parser's
        # business rules require citations whenever the retrieval found relevant evidence.
        "evidence": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        # When the ticket is due to be resolved (the tenant's service levels, apps/tickets/sla.py),
        # set by the agent from the policy, never by the model: UTC, to the second.
        "due_at": {"type": "string", "pattern": r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\+00:00$"},
    },
}

#: the report's files a write carries (apps/attachments): sent to the ticket after it, by digest
ATTACHMENTS_SCHEMA = {
    "type": "array", "maxItems": 10,
    "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "content_type", "size", "sha256"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 200},
            "content_type": {"enum": ["image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf",
                                      "text/plain"]},
            "size": {"type": "integer", "minimum": 1},
            "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        },
    },
}
TICKET_CREATE_SCHEMA["properties"]["attachments"] = ATTACHMENTS_SCHEMA

TOOLS: dict[str, ToolContract] = {
    "device.read": ToolContract(
        name="device.read",
        version="1",
        kind="read",
        object_scope="device",
        preconditions=("device belongs to the task's tenant",),
        deadline_seconds=5,
        retry_class="retry_same_key",
        idempotent_by_key=True,
        result_lookup=None,
        cost_units=0,
        risk="low",
        params_schema={"type": "object", "required": ["device_id"], "properties": {"device_id": {"type": "integer"}}},
    ),
    "ticket.create": ToolContract(
        name="ticket.create",
        version="1",
        kind="write",
        object_scope="device",
        preconditions=("device version equals the approved version", "approval valid and unexpired"),
        deadline_seconds=10,
        retry_class="lookup_then_retry",
        idempotent_by_key=True,
        result_lookup="GET /tickets?idempotency_key=",
        cost_units=5,
        risk="medium",
        params_schema=TICKET_CREATE_SCHEMA,
    ),
}


TICKET_WRITE_BASE = {
    "ticket_id": {"type": "string", "minLength": 1, "maxLength": 100},
    "if_match": {"type": "integer", "minimum": 1},
}

TICKET_COMMENT_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ticket_id", "if_match", "body", "device", "evidence"],
    "properties": {
        **TICKET_WRITE_BASE,
        "body": {"type": "string", "minLength": 10, "maxLength": 8000},
        "device": {"type": "string", "minLength": 1, "maxLength": 64},
        # Empty when no readable procedure covers the report (the draft says so); the parser's
        # business rules require citations whenever the retrieval found relevant evidence.
        "evidence": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        "attachments": ATTACHMENTS_SCHEMA,
    },
}

TICKET_UPDATE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ticket_id", "if_match", "changes", "reason"],
    "properties": {
        **TICKET_WRITE_BASE,
        "changes": {
            "type": "object",
            "additionalProperties": False,
            "minProperties": 1,
            "properties": {
                "status": {"enum": ["open", "in_progress", "resolved", "closed"]},
                "priority": {"enum": ["P1", "P2", "P3", "P4"]},
                "comment": {"type": "string", "minLength": 1, "maxLength": 8000},
            },
        },
        "reason": {"type": "string", "minLength": 5, "maxLength": 500},
    },
}

TOOLS["ticket.comment"] = ToolContract(
    name="ticket.comment",
    version="1",
    kind="write",
    object_scope="ticket",
    preconditions=("the ticket is at the version the comment was planned on (If-Match)",
                   "approval valid and unexpired"),
    deadline_seconds=10,
    retry_class="lookup_then_retry",
    idempotent_by_key=True,
    result_lookup="GET /tickets/<id>/comments?idempotency_key=",
    cost_units=2,
    risk="low",
    params_schema=TICKET_COMMENT_SCHEMA,
    conditional=True,
)
TOOLS["ticket.update"] = ToolContract(
    name="ticket.update",
    version="1",
    kind="write",
    object_scope="ticket",
    preconditions=("the ticket is at the version the update was planned on (If-Match)",
                   "approval valid and unexpired"),
    deadline_seconds=10,
    retry_class="lookup_then_retry",
    idempotent_by_key=True,
    result_lookup="GET /tickets/<id>/updates?idempotency_key=",
    cost_units=2,
    risk="medium",
    params_schema=TICKET_UPDATE_SCHEMA,
    conditional=True,
)


class ParamsInvalid(ValueError):
    """Parameters that do not match the tool's JSON schema; ``problems`` lists each mismatch."""

    def __init__(self, tool: str, problems: list[str]):
        super().__init__(f"{tool}: " + "; ".join(problems))
        self.problems = problems


def params_validate(tool: str, params: dict) -> None:
    """Check ``params`` against the JSON schema of ``tool``'s contract (DESIGN.md §6). Raises
    :class:`ParamsInvalid` listing every mismatch, ``KeyError`` for an unregistered tool."""
    import jsonschema

    schema = TOOLS[tool].params_schema
    problems = [f"{'/'.join(map(str, e.path)) or '(params)'}: {e.message}"
                for e in jsonschema.Draft202012Validator(schema).iter_errors(params)]
    if problems:
        raise ParamsInvalid(tool, problems)


def tool_get(name: str) -> ToolContract:
    """The contract of tool ``name``. Raises ``KeyError`` for an unregistered tool."""
    return TOOLS[name]
