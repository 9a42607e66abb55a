"""The django-helpdesk 2.6 connector (DESIGN.md §11; ADR 0010): its REST API, the action's key in a
custom field, lookups through the deployment's bridge view."""

from __future__ import annotations

from django.conf import settings

from apps.core import tool_errors as errors
from apps.tickets.transport import HttpConnector, Receipt, error_for_status, json_body, lookup_result

HELPDESK_PRIORITY = {"P1": 1, "P2": 2, "P3": 3, "P4": 4}
HELPDESK_STATUS = {1: "open", 2: "reopened", 3: "resolved", 4: "closed", 5: "duplicate"}


#: the extension helpdesk needs to accept a file of each type faultdesk attaches (its
#: ``HELPDESK_VALID_EXTENSIONS`` checks the name only)
_EXTENSION_FOR = {"image/png": ".png", "image/jpeg": ".jpg", "image/gif": ".gif", "image/webp": ".webp",
                  "application/pdf": ".pdf", "text/plain": ".txt"}
_EXTENSIONS_OF = {"text/plain": (".txt", ".log", ".csv", ".json", ".xml", ".cfg", ".conf", ".ini", ".out", ".text"),
                  "image/jpeg": (".jpg", ".jpeg", ".jfif")}


def _with_extension(name: str, content_type: str) -> str:
    """``name``, with the extension of ``content_type`` added when it has none that fits: a log
    sent as ``printer`` goes as ``printer.txt``."""
    fits = _EXTENSIONS_OF.get(content_type, (_EXTENSION_FOR.get(content_type, ""),))
    return name if name.lower().endswith(fits) else name + _EXTENSION_FOR.get(content_type, "")


class HelpdeskConnector(HttpConnector):
    """django-helpdesk 2.6 over its REST API (``Authorization: Token``, injected by the tool gateway),
    DESIGN.md §11.

    It has no idempotency support: the action's key goes into the custom field
    ``faultdesk_key``, and :meth:`lookup_by_key` finds it through the deployment's bridge view.
    The dispatcher reconciles by key before any retry. The deployment's unique index on the key
    answers a second create for the same key with 409, which :meth:`create_ticket` turns into the
    existing ticket.

    It cannot fence a key. Instead, a request can no longer take effect once it is older than
    ``request_lifetime_seconds``: the helpdesk's gunicorn kills a request after ``--timeout``
    (30 s), and the lifetime adds a margin. The dispatcher waits that long after the last
    unanswered attempt before it records "not executed" (:meth:`fence` only looks up).
    """

    name = "helpdesk"
    label = "django-helpdesk"
    idempotent_by_key = False
    supports_fence = False
    #: django-helpdesk's REST API has no ticket version or ``If-Match``: faultdesk never sends it
    #: a comment or an update (the agent files a new ticket, a compensation waits for a person).
    supports_conditional_writes = False

    tool = "ticket.helpdesk"

    def __init__(self, *, base_url: str | None = None, timeout: float | None = None):
        """``base_url`` (default ``HELPDESK_URL``) must be a destination the gateway allows
        ``ticket.helpdesk``; the API token is the gateway's to inject (``HELPDESK_API_TOKEN``)."""
        conf = settings.FAULTDESK
        self.base_url = (base_url or conf["HELPDESK_URL"]).rstrip("/")
        self.timeout = timeout if timeout is not None else conf["HELPDESK_TIMEOUT_SECONDS"]
        self.queue_id = conf["HELPDESK_QUEUE_ID"]
        self.request_lifetime_seconds = conf["HELPDESK_REQUEST_LIFETIME_SECONDS"]

    def _receipt(self, body: dict, *, replayed: bool) -> Receipt:
        status = HELPDESK_STATUS.get(body.get("status"), str(body.get("status")))
        # helpdesk keeps no ticket version: a receipt is version 1, later changes come from reads.
        return Receipt(external_id=str(body["id"]), version=1, status=status, body=body, replayed=replayed,
                       connector=self.name)

    def create_ticket(self, *, idempotency_key: str, fencing_token: int, params: dict,
                      timeout: float | None = None) -> Receipt:
        """POST /helpdesk/api/tickets/ with the key in ``custom_faultdesk_key``. The fencing token
        cannot travel (helpdesk has no such check). Returns a :class:`Receipt`; a 409 (the key's
        ticket already exists) returns that ticket. Raises the module table's error classes."""
        description = "\n".join([
            params.get("description", ""), "",
            f"Device: {params.get('device', '')}",
            f"Requester: {params.get('requester', '')} ({params.get('tenant', '')})",
            f"Labels: {', '.join(params.get('labels', []))}",
            "Evidence:", *[f"- {e}" for e in params.get("evidence", [])],
        ])
        payload = {"queue": self.queue_id, "title": params["title"], "description": description,
                   "priority": HELPDESK_PRIORITY.get(params.get("priority"), 3),
                   "custom_faultdesk_key": idempotency_key}
        if params.get("due_at"):  # the service levels' resolve-by date (apps/tickets/sla.py)
            payload["due_date"] = params["due_at"]
        resp = self._send("POST", "/helpdesk/api/tickets/", what="create", timeout=timeout, json=payload)
        if resp.status_code == 201:
            return self._receipt(json_body(resp, "create"), replayed=False)
        if resp.status_code == 409:
            found = self.lookup_by_key(idempotency_key=idempotency_key)
            if found is not None:
                return found
        raise error_for_status(resp)

    def lookup_by_key(self, *, idempotency_key: str) -> Receipt | None:
        """The ticket whose ``faultdesk_key`` is the key (bridge view), or None."""
        resp = self._send("GET", "/helpdesk/api/faultdesk/tickets/by-custom-field/", what="lookup",
                          params={"field": "faultdesk_key", "value": idempotency_key})
        if resp.status_code != 200:
            raise error_for_status(resp)
        return lookup_result(json_body(resp, "lookup"), idempotency_key, key_field="custom_faultdesk_key",
                              receipt=lambda body: self._receipt(body, replayed=True))

    def fence(self, *, idempotency_key: str, fencing_token: int) -> Receipt | None:
        """No fencing at helpdesk: only the lookup. The caller must first have waited out
        ``request_lifetime_seconds`` since the last unanswered attempt."""
        return self.lookup_by_key(idempotency_key=idempotency_key)

    def execute(self, *, tool: str, idempotency_key: str, fencing_token: int, params: dict,
                timeout: float | None = None) -> Receipt:
        """Only ``ticket.create`` (see :attr:`supports_conditional_writes`)."""
        if tool != "ticket.create":
            raise KeyError(f"django-helpdesk has no conditional {tool!r}")
        return self.create_ticket(idempotency_key=idempotency_key, fencing_token=fencing_token, params=params,
                                  timeout=timeout)

    def lookup(self, *, tool: str, idempotency_key: str, params: dict) -> Receipt | None:
        """The ticket created with ``idempotency_key`` (``ticket.create`` is the only tool here)."""
        return self.lookup_by_key(idempotency_key=idempotency_key)

    def attach(self, *, ticket_id: str, name: str, content_type: str, data: bytes, sha256: str,
               timeout: float | None = None) -> str:
        """The file as a private follow-up of the ticket with the file attached (django-helpdesk's
        ``POST /helpdesk/api/followups/``, multipart ``attachments``), titled with its SHA-256.
        helpdesk has no idempotency key: the ticket's attachments are looked up first (bridge
        view), and a follow-up already titled with this digest is the file, not sent again.
        Returns ``followup:<id>``; raises the module table's error classes (404: no such ticket)."""
        title = f"faultdesk attachment sha256:{sha256}"
        if not ticket_id.isdigit():
            raise errors.PreconditionFailed(f"attach: {ticket_id!r} is not a django-helpdesk ticket id")
        found = self._send("GET", f"/helpdesk/api/faultdesk/tickets/{ticket_id}/attachments/", what="attach lookup",
                           timeout=timeout)
        if found.status_code != 200:
            raise error_for_status(found)
        results = json_body(found, "attach lookup").get("results")
        if not isinstance(results, list):
            raise errors.OutcomeUnknown("attach lookup: the answer holds no results")
        for row in results:
            if isinstance(row, dict) and row.get("title") == title:
                return f"followup:{row.get('followup')}"
        resp = self._send("POST", "/helpdesk/api/followups/", what="attach", timeout=timeout,
                          data={"ticket": ticket_id, "title": title, "public": "false", "user": "",
                                "comment": f"Attached by the requester through faultdesk: {name}"},
                          files={"attachments": (_with_extension(name, content_type), data, content_type)})
        if resp.status_code == 201:
            return f"followup:{json_body(resp, 'attach').get('id')}"
        raise error_for_status(resp)

    def get_ticket(self, *, external_id: str, timeout: float | None = None) -> dict | None:
        """The ticket JSON by id (bridge view), with ``idempotency_key`` set from
        ``custom_faultdesk_key``; None when absent. ``timeout`` as for the reference service."""
        if not external_id.isdigit():
            return None
        resp = self._send("GET", f"/helpdesk/api/faultdesk/tickets/{external_id}/", what="read", timeout=timeout)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise error_for_status(resp)
        body = json_body(resp, "read")
        if not isinstance(body, dict) or "id" not in body:
            raise errors.OutcomeUnknown("read: the answer is not a ticket")
        return {**body, "id": str(body["id"]), "version": 1, "status": HELPDESK_STATUS.get(body.get("status")),
                "idempotency_key": body.get("custom_faultdesk_key") or None}
