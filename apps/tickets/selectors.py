"""Reads of tickets for the agent's plan (DESIGN.md §11)."""

from __future__ import annotations

from apps.core import sql
from apps.tickets.connectors import CONNECTORS, connector_for
from apps.tickets.models import SlaPolicy, TicketMirror
from apps.tickets.sla import Deadlines, Policy, SlaConfigError, request_priority

#: ticket statuses in which a new report for the device belongs on the ticket as a comment
OPEN_STATUSES = ("open", "in_progress")


#: the device's mirrored tickets that are open, of a task not being taken back — unless its
#: compensation kept the ticket open (rejected, or resolved as not needed)
_ACTION = TicketMirror._meta.get_field("action").related_model
_OPEN_MIRROR_WHERE = """
t0.connector = %s AND t0.status = ANY(%s)
AND EXISTS (SELECT 1 FROM {action} a JOIN {task} t ON t.id = a.task_id
            WHERE a.id = t0.action_id AND t.device_id = %s
              AND (t.status NOT IN ('CANCELLED', 'COMPENSATING', 'WAITING_COMPENSATION')
                   OR t.state -> 'compensation' ->> 'status' IN ('REJECTED', 'RESOLVED')))
""".format(action=_ACTION._meta.db_table,  # noqa: S608 - table names from the models
           task=_ACTION._meta.get_field("task").related_model._meta.db_table)


def open_mirror_for_device(*, tenant_id: int, device_id: int, connector: str) -> TicketMirror | None:
    """The device's newest mirrored ticket in ``connector`` that faultdesk created and that is open,
    of a task not being taken back (unless its compensation kept the ticket open) — as mirrored,
    without asking the ticket system; None when there is none. One statement."""
    return sql.row(TicketMirror, _OPEN_MIRROR_WHERE, [connector, list(OPEN_STATUSES), device_id],
                   tenant_id=tenant_id, tail="ORDER BY t0.updated_at DESC LIMIT 1")


def open_ticket_read(*, tenant_id: int, device_id: int, connector: str,
                     timeout: float | None = None) -> dict | None:
    """The device's newest open ticket that faultdesk created in ``connector``, read again from the
    ticket system itself for its current version: ``{"connector", "external_id", "version",
    "status", "priority", "title"}``, or None when there is none, it is no longer open, or the
    ticket system has no conditional writes (a comment could not be made conditional on it).

    Raises the connector's :class:`~apps.actions.errors.ToolError` when the ticket system cannot be
    read (the caller retries later; it never guesses). ``timeout`` (seconds): the caller's
    deadline-bounded budget for the read (default: the connector's own)."""
    if not CONNECTORS[connector].supports_conditional_writes:
        return None
    # A ticket whose request was cancelled may be about to be closed (its compensation): it takes a
    # comment only once that compensation kept it open (rejected, or resolved as not needed).
    mirror = open_mirror_for_device(tenant_id=tenant_id, device_id=device_id, connector=connector)
    if mirror is None:
        return None
    ticket = connector_for("ticket.comment", connector).get_ticket(external_id=mirror.external_id, timeout=timeout)
    if ticket is None or ticket.get("status") not in OPEN_STATUSES:
        if ticket is not None and ticket.get("version", 0) > mirror.external_version:
            TicketMirror.objects.for_tenant(tenant_id).filter(
                pk=mirror.pk, external_version__lt=ticket["version"]).update(status=ticket["status"],
                                                                            external_version=ticket["version"])
        return None
    return ticket_snapshot(ticket, connector)


def ticket_snapshot(ticket: dict, connector: str) -> dict:
    """The recorded shape of a ticket read (as in ``ticket.read``) from the ticket system's JSON."""
    return {"connector": connector, "external_id": str(ticket["id"]), "version": int(ticket["version"]),
            "status": ticket.get("status"), "priority": ticket.get("priority"), "title": ticket.get("title", "")}


def sla_policy_for(tenant_id: int) -> Policy:
    """The tenant's service levels (:class:`~apps.tickets.sla.Policy`): its ``SlaPolicy`` row,
    else the defaults (Monday to Friday, 09:00–18:00 UTC, no holidays,
    :data:`~apps.tickets.sla.DEFAULT_TARGETS`). One query; ``SlaConfigError`` when the row is unusable."""
    row = SlaPolicy.objects.filter(tenant_id=tenant_id).first()
    return row.policy() if row is not None else Policy()


def request_deadlines(*, tenant_id: int, created_at, state: dict | None, urgency: str | None) -> Deadlines | None:
    """A request's due dates (:class:`~apps.tickets.sla.Deadlines`) under its tenant's service
    levels, counted from ``created_at`` at the priority :func:`~apps.tickets.sla.request_priority`
    reads from ``state`` and ``urgency``; None when the tenant's policy cannot give a date. One query."""
    try:
        return sla_policy_for(tenant_id).deadlines(created_at, request_priority(state, urgency))
    except SlaConfigError:
        return None
