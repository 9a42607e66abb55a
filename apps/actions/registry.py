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
        "evidence": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 10},
    },
}

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


def tool_get(name: str) -> ToolContract:
    """The contract of tool ``name``. Raises ``KeyError`` for an unregistered tool."""
    return TOOLS[name]
