"""Writes of the action identity (DESIGN.md §6): an action row is created once per logical action,
by the intent, with the idempotency key every send of it carries."""

from __future__ import annotations

import json
import uuid

from django.db import connection

from apps.actions.models import Action, ActionStatus


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


_SUCCEEDED_MANY_SQL = """
UPDATE {table} AS a SET status = %s, receipt = v.receipt::jsonb, external_id = v.external_id,
    external_version = v.external_version::integer, updated_at = %s
FROM (VALUES {rows}) AS v(id, receipt, external_id, external_version)
WHERE a.id = v.id
"""
_SUCCEEDED_ROW = "(%s::uuid, %s, %s, %s)"


def actions_mark_succeeded(actions: list[Action], *, now) -> None:
    """Write the receipts of several actions in one ``UPDATE … FROM (VALUES …)`` (the outbox's
    batched receipts, DESIGN.md §6): each action's ``status``, ``receipt``, ``external_id`` and
    ``external_version`` as set on the in-memory ``actions``, and ``updated_at = now``. Django's
    ``bulk_update`` writes the same with a ``CASE WHEN`` per field and row, which cost the
    dispatcher 9% of its CPU. The caller holds the rows locked in its transaction; every status is
    SUCCEEDED (raises ``ValueError`` otherwise, writing nothing)."""
    if not actions:
        return
    if any(a.status != ActionStatus.SUCCEEDED for a in actions):
        raise ValueError("actions_mark_succeeded writes succeeded actions only")
    params: list = [ActionStatus.SUCCEEDED.value, now]
    for action in actions:
        params += [str(action.pk), json.dumps(action.receipt), action.external_id, action.external_version]
    sql = _SUCCEEDED_MANY_SQL.format(table=Action._meta.db_table, rows=", ".join([_SUCCEEDED_ROW] * len(actions)))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
    for action in actions:
        action.updated_at = now
