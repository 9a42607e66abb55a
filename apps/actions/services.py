"""Writes of the action identity (DESIGN.md §6): an action row is created once per logical action,
by the intent, with the idempotency key every send of it carries."""

from __future__ import annotations

import uuid

from apps.actions.models import Action


def action_create(*, action_id: uuid.UUID, tenant_id: int, task_id: uuid.UUID, tool, connector: str, params: dict,
                  params_digest: str, idempotency_key: str, approval=None, object_version: int,
                  compensates: Action | None = None) -> Action:
    """Create the action ``action_id`` for ``tool`` (a :class:`~apps.actions.registry.ToolContract`:
    its name, version and cost units, which become the action's reservation) at ``connector``.
    Call inside the intent's transaction. ``params_digest`` is h(a) of ``params``; ``approval`` the
    granted :class:`~apps.approvals.models.ApprovalRequest` it follows, if any; ``compensates`` the
    action whose effect this one takes back. Raises ``IntegrityError`` for a key already bound."""
    return Action.objects.create(
        id=action_id, tenant_id=tenant_id, task_id=task_id, tool=tool.name, tool_version=tool.version,
        connector=connector, params=params, params_digest=params_digest, idempotency_key=idempotency_key,
        approval=approval, object_version=object_version, reservation=tool.cost_units, compensates=compensates,
    )
