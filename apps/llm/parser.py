"""Output parser ``ticket-draft-parser/1`` (DESIGN.md §1 step 4): structure by JSON schema, then
business rules (required fields, value ranges, evidence that was actually retrieved)."""

from __future__ import annotations

import jsonschema

from apps.actions.registry import TICKET_CREATE_SCHEMA

PARSER_VERSION = "ticket-draft-parser/1"

DRAFT_SCHEMA = {
    "type": "object",
    "required": ["ticket", "alert_summary", "missing_information", "model"],
    "properties": {
        "ticket": TICKET_CREATE_SCHEMA,
        "alert_summary": {"type": "string"},
        "missing_information": {"type": "array", "items": {"type": "string"}},
        "model": {"type": "string"},
    },
}


def draft_validate(*, draft: dict, evidence_ids: set[str], device_asset_tag: str, tenant: str) -> list[str]:
    """Return the list of problems with ``draft`` (empty when valid).

    Checks the JSON schema, that the ticket names the task's device and tenant, that every cited
    evidence id was retrieved for this task, and that it cites at least one when any was (a task
    whose retrieval found no relevant procedure has none to cite, and its draft cites nothing).
    """
    problems = [
        f"{'/'.join(str(p) for p in err.absolute_path) or '(root)'}: {err.message}"
        for err in jsonschema.Draft202012Validator(DRAFT_SCHEMA).iter_errors(draft)
    ]
    if problems:
        return problems
    ticket = draft["ticket"]
    if ticket["device"] != device_asset_tag:
        problems.append(f"ticket names device {ticket['device']!r}, the task is about {device_asset_tag!r}")
    if ticket["tenant"] != tenant:
        problems.append("ticket names another tenant")
    unknown = set(ticket["evidence"]) - evidence_ids
    if unknown:
        problems.append(f"cites evidence that was not retrieved: {sorted(unknown)}")
    if evidence_ids and not ticket["evidence"]:
        problems.append("cites no evidence, though relevant evidence was retrieved: cite the chunk_id values used")
    return problems
