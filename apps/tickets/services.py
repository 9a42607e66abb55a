"""Writes of the ticket mirror (DESIGN.md §6, step 8): what faultdesk knows of the tickets its
actions created, as their receipts said."""

from __future__ import annotations

import json

from django.db import connection

from apps.tickets.models import TicketMirror

_UPSERT_SQL = """
INSERT INTO {mirror} (tenant_id, action_id, connector, external_id, external_version, status, data, updated_at)
VALUES {rows}
ON CONFLICT (action_id) DO UPDATE SET tenant_id = EXCLUDED.tenant_id, connector = EXCLUDED.connector,
    external_id = EXCLUDED.external_id, external_version = EXCLUDED.external_version, status = EXCLUDED.status,
    data = EXCLUDED.data, updated_at = EXCLUDED.updated_at
"""
_ROW = "(%s, %s::uuid, %s, %s, %s, %s, %s::jsonb, %s)"


def mirrors_record_created(created: list[tuple], *, now) -> None:
    """Record the tickets that receipts of ``ticket.create`` actions name, in one statement:
    ``created`` is ``[(action, receipt)]`` (an :class:`~apps.actions.models.Action` and its
    :class:`~apps.tickets.connectors.Receipt`); the mirror row of each action is written, or
    overwritten if one exists, with the receipt's connector, ticket id, version, status and body
    and ``updated_at = now``. Call in the receipt's transaction. Raises ``IntegrityError`` when
    another action's mirror already names that ticket."""
    if not created:
        return
    params: list = []
    for action, receipt in created:
        params += [action.tenant_id, str(action.pk), receipt.connector, receipt.external_id, receipt.version,
                   receipt.status, json.dumps(receipt.body), now]
    statement = _UPSERT_SQL.format(mirror=TicketMirror._meta.db_table, rows=", ".join([_ROW] * len(created)))
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
