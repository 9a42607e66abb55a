"""Writes of the action identity (DESIGN.md §6): an action row is created once per logical action,
by the intent, with the idempotency key every send of it carries."""

from __future__ import annotations

import json
import uuid

from django.db import connection

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.core import sql


def action_create(*, action_id: uuid.UUID, tenant_id: int, task_id: uuid.UUID, tool, connector: str, params: dict,
                  params_digest: str, idempotency_key: str, approval=None, object_version: int,
                  compensates: Action | None = None) -> Action:
    """Create the action ``action_id`` for ``tool`` (a :class:`~apps.actions.registry.ToolContract`:
    its name, version and cost units, which become the action's reservation) at ``connector``.
    Call inside the intent's transaction. ``params_digest`` is h(a) of ``params``; ``approval`` the
    granted :class:`~apps.approvals.models.ApprovalRequest` it follows, if any; ``compensates`` the
    action whose effect this one takes back. Raises ``IntegrityError`` for a key already bound."""
    return sql.insert(Action(
        id=action_id, tenant_id=tenant_id, task_id=task_id, tool=tool.name, tool_version=tool.version,
        connector=connector, params=params, params_digest=params_digest, idempotency_key=idempotency_key,
        approval=approval, object_version=object_version, reservation=tool.cost_units, compensates=compensates,
    ))


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


_ATTEMPTS_START_SQL = """
INSERT INTO {attempt} (action_id, number, fencing_token, outcome, error, started_at, finished_at, worker)
SELECT v.action_id, COALESCE((SELECT max(a.number) FROM {attempt} a WHERE a.action_id = v.action_id), 0) + 1,
       v.token, %(outcome)s, NULL, %(now)s, NULL, %(worker)s
FROM unnest(%(actions)s::uuid[], %(tokens)s::int[]) AS v(action_id, token)
RETURNING id, action_id, number
"""


def attempts_start(actions: list[tuple[Action, int]], *, worker: str, now) -> dict:
    """Write one ``IN_FLIGHT`` attempt row for each ``(action, fencing_token)`` — numbered after the
    action's existing attempts — in one statement, before the requests leave (DESIGN.md §6: a crash
    mid-call leaves an attempt as evidence). The caller holds the actions' outbox rows locked at
    their fencing tokens, so no other attempt of these actions is being written. One action at most
    once. Returns ``{action_id: ActionAttempt}`` (as written). Raises ``ValueError`` for an action
    named twice (writing nothing), ``IntegrityError`` when a number is taken after all."""
    if not actions:
        return {}
    ids = [action.pk for action, _ in actions]
    if len(set(ids)) != len(ids):
        raise ValueError("one attempt per action")
    by_id = {action.pk: (action, token) for action, token in actions}
    with connection.cursor() as cursor:
        cursor.execute(_ATTEMPTS_START_SQL.format(attempt=ActionAttempt._meta.db_table), {
            "outcome": AttemptOutcome.IN_FLIGHT.value, "now": now, "worker": worker,
            "actions": [str(i) for i in ids], "tokens": [token for _, token in actions]})
        written = cursor.fetchall()
    out = {}
    for attempt_id, action_id, number in written:
        action, token = by_id[action_id]
        attempt = ActionAttempt(id=attempt_id, action=action, number=number, fencing_token=token, started_at=now,
                                worker=worker)
        attempt._state.adding, attempt._state.db = False, connection.alias
        out[action_id] = attempt
    return out


_ATTEMPTS_RECEIPT_SQL = """
UPDATE {attempt} SET finished_at = %(now)s,
    outcome = CASE WHEN id = ANY(%(mine)s) THEN %(receipt)s ELSE %(unknown)s END,
    error = CASE WHEN id = ANY(%(mine)s) THEN error ELSE %(orphaned)s::jsonb END
WHERE id = ANY(%(mine)s) OR (action_id = ANY(%(actions)s::uuid[]) AND outcome = %(in_flight)s)
"""

#: what an attempt whose dispatcher never reported says once its action has a receipt
ORPHANED_ATTEMPT = {"detail": "no report from its dispatcher; the action has its receipt"}


def attempts_close_with_receipt(*, action_ids: list, attempt_ids: list, now) -> None:
    """The attempts of actions that now have their receipt, in one statement: ``attempt_ids``
    (the ones that brought a receipt) end ``RECEIPT``; any other attempt of ``action_ids`` still
    ``IN_FLIGHT`` — its dispatcher died or stalls, and it may be the one that created the ticket —
    ends ``UNKNOWN`` with :data:`ORPHANED_ATTEMPT` as its error. Call in the receipt's transaction."""
    if not action_ids and not attempt_ids:
        return
    with connection.cursor() as cursor:
        cursor.execute(_ATTEMPTS_RECEIPT_SQL.format(attempt=ActionAttempt._meta.db_table), {
            "now": now, "mine": list(attempt_ids), "actions": [str(i) for i in action_ids],
            "receipt": AttemptOutcome.RECEIPT.value, "unknown": AttemptOutcome.UNKNOWN.value,
            "in_flight": AttemptOutcome.IN_FLIGHT.value, "orphaned": json.dumps(ORPHANED_ATTEMPT)})
