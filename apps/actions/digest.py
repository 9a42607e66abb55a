"""Canonical digests (DESIGN.md §6): ``h(a)`` = SHA-256 of the RFC 8785 canonical JSON of
(tool, tool version, parameters)."""

from __future__ import annotations

import hashlib
import json

from apps.core.digests import canonical_json, sha256_json


def action_digest(*, tool: str, tool_version: str, params: dict) -> str:
    """h(a): hex SHA-256 of the canonical JSON of ``{"tool", "tool_version", "params"}``."""
    return sha256_json({"tool": tool, "tool_version": tool_version, "params": params})


def proposal_digest(proposal: dict) -> str:
    """h(a) recomputed from a proposal's own ``tool``, ``tool_version`` and ``params`` — never
    read from its stored ``digest``, which is only a label that can be left behind when the
    parameters change (DESIGN.md §7: an approval binds what is sent)."""
    return action_digest(tool=proposal["tool"], tool_version=proposal["tool_version"], params=proposal["params"])


def sendable(*, tool: str, tool_version: str, params: dict) -> tuple[dict, str]:
    """``(params, h(a))`` for a send: the parameters decoded from the very canonical bytes that
    are hashed, so what the connector is handed is byte for byte what the digest covers (no
    object shared with the caller, nothing that can change between the check and the send)."""
    raw = canonical_json({"tool": tool, "tool_version": tool_version, "params": params})
    return json.loads(raw)["params"], hashlib.sha256(raw).hexdigest()


def idempotency_key(*, tenant_slug: str, tool: str, task_id: str, digest: str, intent_seq: int) -> str:
    """k_a: one key per logical action — scoped by tenant and operation, derived from the task, h(a)
    and the seq of the ``intent.committed`` event that created the action. It is stored on the
    action, so every retry, restart and re-dispatch of that action uses the same key; a new intent
    after a re-plan (e.g. an approval that expired before dispatch) is a new logical action."""
    inner = hashlib.sha256(f"{task_id}:{digest}:{intent_seq}".encode()).hexdigest()[:32]
    return f"{tenant_slug}:{tool}:{inner}"


#: the kind of change each write makes, for :func:`action_identity`
_CHANGE_KIND = {"ticket.create": "create", "ticket.comment": "comment", "ticket.update": "update"}


def action_identity(*, tool: str, params: dict) -> dict:
    """What an action *is*, as a rejection remembers it (spec §16.6: a rejection is a constraint on
    later proposals, not a transient error to retry): ``{"tool", "target", "change"}``.

    * ``target`` — the object it writes: ``ticket/<id>`` for a write on an existing ticket,
      ``device/<asset tag>`` for a new ticket about a device;
    * ``change`` — the kind of change: ``create``, ``comment``, or for an update
      ``update:<changed fields, sorted, with a status or priority's new value>``.

    Wording (title, description, a comment's body, the cited evidence, the attachments' list, the
    due date) is not part of it: two drafts that differ only in words are the same action. Pure;
    raises nothing for an unknown tool (its change kind is the tool's name)."""
    params = params if isinstance(params, dict) else {}
    if params.get("ticket_id") is not None:
        target = f"ticket/{params['ticket_id']}"
    else:
        target = f"device/{params.get('device')}"
    change = _CHANGE_KIND.get(tool, tool)
    if change == "update":
        changes = params.get("changes") if isinstance(params.get("changes"), dict) else {}
        parts = [f"{k}={changes[k]}" if k in ("status", "priority") else k for k in sorted(changes)]
        change = "update:" + ",".join(parts)
    return {"tool": tool, "target": target, "change": change}
