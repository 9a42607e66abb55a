"""Connectors to external ticket systems (DESIGN.md §11): which connector executes a write tool on
which ticket system. The connectors are :mod:`apps.tickets.reference` (the reference ticket
service) and :mod:`apps.tickets.helpdesk` (django-helpdesk), over :mod:`apps.tickets.transport`.
Every request goes through the tool gateway (:mod:`apps.gateway`), which checks its destination,
injects the credential, caps the answer and records the call; no connector holds a credential, and
nothing here is visible to the model.

Every transport or HTTP failure is mapped to exactly one class of :mod:`apps.actions.errors`:

=========================================  ================================
what happened                              error class
=========================================  ================================
connection refused / connect timeout       ``DefinitelyNotExecuted``
destination refused by the tool gateway    ``DefinitelyNotExecuted`` (nothing left the process)
read timeout, deadline, dropped connection ``OutcomeUnknown``
answer over the gateway's cap, 3xx, 5xx    ``OutcomeUnknown``
503 / 429                                  ``TemporarilyUnavailable``
400 / 422                                  ``InvalidParams``
401 / 403                                  ``Unauthorized``
409 (request with the key in progress)     ``TemporarilyUnavailable``
409 (stale fencing token) / 412 / 404       ``PreconditionFailed``
=========================================  ================================
"""

from __future__ import annotations

from apps.tickets.helpdesk import HelpdeskConnector
from apps.tickets.reference import ReferenceTicketConnector
from apps.tickets.transport import Receipt, ticket_receipt

__all__ = ["CONNECTORS", "WRITE_TOOLS", "HelpdeskConnector", "Receipt", "ReferenceTicketConnector", "connector_for",
           "ticket_receipt"]


CONNECTORS = {ReferenceTicketConnector.name: ReferenceTicketConnector, HelpdeskConnector.name: HelpdeskConnector}


def connector_for(tool: str, connector: str = "reference") -> ReferenceTicketConnector | HelpdeskConnector:
    """The connector that executes ``tool`` on the ticket system named ``connector`` (an action's
    ``connector`` field). Raises ``KeyError`` for an unknown tool or ticket system, or a write on
    an existing ticket at a ticket system without conditional writes."""
    cls = CONNECTORS[connector]
    if tool not in WRITE_TOOLS or (tool != "ticket.create" and not cls.supports_conditional_writes):
        raise KeyError(f"no connector for tool {tool!r} on {connector!r}")
    return cls()


#: the write tools a connector executes
WRITE_TOOLS = ("ticket.create", "ticket.comment", "ticket.update")
