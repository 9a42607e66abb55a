"""The reference ticket service's connector (DESIGN.md §11; its API: :mod:`tools.refservice`):
creates with ``Idempotency-Key`` and ``X-Fencing-Token``, alone or several to a request
(``POST /ticket-batches``), lookups and fences by key, conditional comments and updates."""

from __future__ import annotations

from urllib.parse import quote

from django.conf import settings

from apps.core import tool_errors as errors
from apps.tickets.transport import (
    HttpConnector,
    Receipt,
    error_for,
    error_for_status,
    json_body,
    lookup_result,
    lookup_results,
    ticket_receipt,
)

#: base URLs of reference services this process found without ``POST /ticket-batches`` (404/405)
_NO_BATCH_ENDPOINT: set[str] = set()


#: the refusals ``POST /ticket-batches`` gives an item (what ``POST /tickets`` answers before or
#: instead of creating: invalid, key in progress or fenced, key reused, unavailable); any other
#: item status is not a refusal this connector can trust
_BATCH_ITEM_REFUSALS = frozenset({400, 409, 422, 503})


def _ticket_for_key(body: dict, idempotency_key: str, *, replayed: bool) -> Receipt:
    """The receipt of a ticket the reference service returned for ``idempotency_key``. Raises
    ``OutcomeUnknown`` when the ticket names another key: an answer that is not this request's
    (a misbehaving proxy or connection) must never become its receipt — the reconciler looks the
    key up instead."""
    if not isinstance(body, dict) or body.get("idempotency_key") != idempotency_key:
        found = body.get("idempotency_key") if isinstance(body, dict) else None
        raise errors.OutcomeUnknown(f"the answer is for another idempotency key ({found!r}), not this request's")
    return ticket_receipt(body, replayed=replayed)


def ticket_fields(params: dict) -> dict:
    """A ``ticket.create``'s parameters as the ticket's body: without ``attachments`` (their bytes go
    to the ticket after it exists, by :meth:`ReferenceTicketConnector.attach`)."""
    return {k: v for k, v in params.items() if k != "attachments"}


class ReferenceTicketConnector(HttpConnector):
    """The reference ticket service over HTTP: create with ``Idempotency-Key`` and
    ``X-Fencing-Token``, look up by key, fence a key, comment and update conditionally, get by id."""

    name = "reference"
    label = "the reference ticket service"
    #: The remote deduplicates by ``Idempotency-Key``: a resend returns the stored response.
    idempotent_by_key = True
    #: The remote can fence a key (ADR 0009): "not executed" is provable at once.
    supports_fence = True
    #: Comments and updates are conditional on the ticket's version (``If-Match``, 412).
    supports_conditional_writes = True

    tool = "ticket.reference"

    def __init__(self, *, base_url: str | None = None, timeout: float | None = None):
        """``base_url`` (default ``REFSERVICE_URL``) must be a destination the gateway allows
        ``ticket.reference``; the bearer key is the gateway's to inject (``REFSERVICE_API_KEY``)."""
        conf = settings.FAULTDESK
        self.base_url = (base_url or conf["REFSERVICE_URL"]).rstrip("/")
        self.timeout = timeout if timeout is not None else conf["REFSERVICE_TIMEOUT_SECONDS"]
        self.keep_alive = conf["REFSERVICE_KEEPALIVE"]

    def create_ticket(self, *, idempotency_key: str, fencing_token: int, params: dict,
                      timeout: float | None = None) -> Receipt:
        """POST /tickets. Returns a :class:`Receipt`; raises a :class:`~apps.actions.errors.ToolError`
        subclass per the module table. ``timeout`` (seconds) is bounded by the caller's deadline."""
        resp = self._send("POST", "/tickets", what="create", timeout=timeout, json=ticket_fields(params),
                          headers={"Idempotency-Key": idempotency_key, "X-Fencing-Token": str(fencing_token)})
        if resp.status_code in (200, 201):
            return _ticket_for_key(json_body(resp, "create"), idempotency_key,
                                   replayed=resp.headers.get("Idempotent-Replayed") == "true")
        raise error_for_status(resp)

    @property
    def batch_size(self) -> int:
        """The most creates :meth:`create_tickets` sends in one request (``REFSERVICE_BATCH_SIZE``;
        1 when this process found the service has no batch endpoint)."""
        if self.base_url in _NO_BATCH_ENDPOINT:
            return 1
        return max(1, settings.FAULTDESK["REFSERVICE_BATCH_SIZE"])

    def create_tickets(self, items: list[tuple[str, int, dict]], *,
                       timeout: float | None = None) -> list[Receipt | errors.ToolError]:
        """POST /ticket-batches: several creates, ``items`` as ``[(idempotency_key, fencing_token,
        params)]`` (keys distinct), in one request; the service handles each as its own
        ``POST /tickets`` and answers one result per item, in the order sent. Returns one outcome
        per item, in order: its :class:`Receipt`, or the :class:`~apps.actions.errors.ToolError`
        the module table gives for its own result. Raises nothing.

        An outcome is only as certain as its tie to the item. A receipt needs a ticket naming the
        item's key (the remote's own record of which request made it). A refusal (an error result,
        definite or not) counts only when the answer lines up — as many results as items, result
        *i* labelled with item *i*'s key: the label is the only tie an error result has, and in a
        misaligned answer it may be another item's. Every other item is ``OutcomeUnknown`` (the
        reconciler looks its key up), as is every item of an unanswered batch (one that never left
        is ``DefinitelyNotExecuted``) or of an answer that cannot be read. One item's malformed
        result makes only that item unknown. A batch refused as such before anything was done (400,
        404, 405, 413) is sent item by item (after a 404 or 405 this process sends every create
        alone); 401/403 and 429/503 are that refusal for every item; any other status is unknown
        for every item."""
        try:
            return self._create_tickets(items, timeout)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong reading the answer, nothing is known
            return [errors.OutcomeUnknown(f"batch create: an unreadable answer: {exc!r}")] * len(items)

    def _create_tickets(self, items: list[tuple[str, int, dict]], timeout: float | None):
        if len(items) == 1 or self.batch_size == 1:
            return [self._create_or_error(key, token, params, timeout) for key, token, params in items]
        body = {"items": [{"idempotency_key": key, "fencing_token": token, "ticket": ticket_fields(params)}
                          for key, token, params in items]}
        try:
            resp = self._send("POST", "/ticket-batches", what="batch create", timeout=timeout, json=body)
        except errors.ToolError as exc:
            return [exc] * len(items)
        code = resp.status_code
        if code in (400, 404, 405, 413):
            if code in (404, 405):
                _NO_BATCH_ENDPOINT.add(self.base_url)
            return [self._create_or_error(key, token, params, timeout) for key, token, params in items]
        if code in (401, 403, 429, 503):
            return [error_for_status(resp)] * len(items)
        if code != 200:
            return [errors.OutcomeUnknown(f"batch create: HTTP {code}, not a batch answer")] * len(items)
        try:
            results = resp.json().get("results")
        except (ValueError, AttributeError, RecursionError):
            results = None
        if not isinstance(results, list):
            return [errors.OutcomeUnknown("batch create: the answer holds no results")] * len(items)
        aligned = len(results) == len(items) and all(
            isinstance(result, dict) and result.get("idempotency_key") == key
            for result, (key, _, _) in zip(results, items, strict=False))
        if aligned:
            return [self._batch_outcome(key, result) for result, (key, _, _) in zip(results, items, strict=True)]
        # Misaligned: only a ticket that names an item's key is that item's; nothing else is known.
        outcomes = []
        for key, _, _ in items:
            tickets = [r for r in results if isinstance(r, dict) and r.get("status") in (200, 201)
                       and isinstance(r.get("ticket"), dict) and r["ticket"].get("idempotency_key") == key]
            outcome = self._batch_outcome(key, tickets[0]) if len(tickets) == 1 else None
            outcomes.append(outcome if isinstance(outcome, Receipt) else errors.OutcomeUnknown(
                f"batch create: the answer does not line up with the items sent; no ticket of its own for {key!r}"))
        return outcomes

    @staticmethod
    def _batch_outcome(key: str, result) -> Receipt | errors.ToolError:
        """One item's outcome from its own result in a batch answer. A result that cannot be read
        as an answer (any failure interpreting it) is ``OutcomeUnknown`` for this item alone."""
        try:
            status = result["status"]
            if isinstance(status, bool) or not isinstance(status, int):
                raise TypeError(f"status {status!r}")
            if status in (200, 201):
                return _ticket_for_key(result.get("ticket"), key, replayed=result.get("replayed") is True)
            if status not in _BATCH_ITEM_REFUSALS or result.get("ticket") is not None:
                # a status the endpoint never gives an item, or a refusal that carries a ticket
                raise ValueError(f"status {status} with ticket {result.get('ticket')!r}")
            return error_for(status, result)
        except errors.ToolError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with this result is this item's alone
            return errors.OutcomeUnknown(f"batch create: an unreadable result for {key!r}: {exc!r}")

    def _create_or_error(self, key: str, token: int, params: dict, timeout: float | None):
        try:
            return self.create_ticket(idempotency_key=key, fencing_token=token, params=params, timeout=timeout)
        except errors.ToolError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - an answer that cannot be read is this item's, and unknown
            return errors.OutcomeUnknown(f"create: an unreadable answer: {exc!r}")

    def lookup_by_key(self, *, idempotency_key: str) -> Receipt | None:
        """GET /tickets?idempotency_key=… → the ticket created with that key, or None.
        Raises ``OutcomeUnknown``/``DefinitelyNotExecuted`` when the lookup itself fails."""
        resp = self._send("GET", "/tickets", what="lookup", params={"idempotency_key": idempotency_key})
        if resp.status_code != 200:
            raise error_for_status(resp)
        return lookup_result(json_body(resp, "lookup"), idempotency_key, key_field="idempotency_key",
                              receipt=lambda body: _ticket_for_key(body, idempotency_key, replayed=True))

    def fence(self, *, idempotency_key: str, fencing_token: int) -> Receipt | None:
        """POST /fences: raise the key's fencing token at the remote to ``fencing_token`` and
        look the key up in the same remote transaction. Returns the ticket created with the key
        as a :class:`Receipt`, or None — and then no request carrying a lower token can ever
        create one (DESIGN.md §6: "not executed" is only recorded after this).

        Raises ``PreconditionFailed`` (409) when a higher token already reached the remote (the
        caller is stale), ``DefinitelyNotExecuted``/``OutcomeUnknown`` when the call fails."""
        resp = self._send("POST", "/fences", what="fence",
                          headers={"Idempotency-Key": idempotency_key, "X-Fencing-Token": str(fencing_token)})
        if resp.status_code != 200:
            raise error_for_status(resp)
        data = json_body(resp, "fence")
        highest = data.get("highest_fencing_token") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("idempotency_key") != idempotency_key \
                or isinstance(highest, bool) or not isinstance(highest, int) or highest < fencing_token:
            # "Nothing found" is only final from the fence of this key at this token (or above): any
            # other answer (another key's, a lower token's, an empty one) proves nothing.
            raise errors.OutcomeUnknown("fence: the answer is not this key's fence at this token")
        if data.get("ticket") is not None:
            return _ticket_for_key(data["ticket"], idempotency_key, replayed=True)
        if data.get("comment") is not None:
            return self._comment_receipt(data["comment"], replayed=True)
        if data.get("update") is not None:
            return self._update_receipt(data["update"], replayed=True)
        return None

    # --- one interface for every write tool (the outbox dispatches by the action's tool) --------

    def execute(self, *, tool: str, idempotency_key: str, fencing_token: int, params: dict,
                timeout: float | None = None) -> Receipt:
        """Send the write of ``tool`` (``ticket.create``, ``ticket.comment``, ``ticket.update``)
        with its parameters as validated by the tool's schema. Returns a :class:`Receipt`; raises
        the module table's error classes (412 ``PreconditionFailed``: the ticket moved on)."""
        if tool == "ticket.create":
            return self.create_ticket(idempotency_key=idempotency_key, fencing_token=fencing_token, params=params,
                                      timeout=timeout)
        if tool == "ticket.comment":
            return self.add_comment(ticket_id=params["ticket_id"], idempotency_key=idempotency_key,
                                    fencing_token=fencing_token, body=params["body"], if_match=params["if_match"],
                                    timeout=timeout)
        if tool == "ticket.update":
            return self.update_ticket(ticket_id=params["ticket_id"], if_match=params["if_match"],
                                      changes=params["changes"], idempotency_key=idempotency_key,
                                      fencing_token=fencing_token, timeout=timeout)
        raise KeyError(f"the reference ticket service has no tool {tool!r}")

    def lookup(self, *, tool: str, idempotency_key: str, params: dict) -> Receipt | None:
        """The result lookup of the tool's contract: the write made with ``idempotency_key``, or
        None. Raises ``OutcomeUnknown``/``DefinitelyNotExecuted`` when the lookup itself fails."""
        if tool == "ticket.create":
            return self.lookup_by_key(idempotency_key=idempotency_key)
        kind = {"ticket.comment": "comments", "ticket.update": "updates"}[tool]
        resp = self._send("GET", f"/tickets/{quote(params['ticket_id'], safe='')}/{kind}", what="lookup",
                          params={"idempotency_key": idempotency_key})
        if resp.status_code == 404:
            return None  # no such ticket: nothing was written to it
        if resp.status_code != 200:
            raise error_for_status(resp)
        results = lookup_results(json_body(resp, "lookup"))
        if not results:
            return None
        if tool == "ticket.comment":
            return self._comment_receipt(results[0], replayed=True)
        return self._update_receipt(results[0], replayed=True)

    def _comment_receipt(self, data: dict, *, replayed: bool) -> Receipt:
        return Receipt(external_id=data["comment"]["id"], version=int(data["ticket_version"]), status="commented",
                       body=data, replayed=replayed, connector=self.name, kind="comment", ticket_id=data["ticket_id"])

    def _update_receipt(self, ticket: dict, *, replayed: bool) -> Receipt:
        return Receipt(external_id=ticket["id"], version=int(ticket["version"]), status=ticket.get("status", ""),
                       body=ticket, replayed=replayed, connector=self.name, kind="update", ticket_id=ticket["id"])

    def add_comment(self, *, ticket_id: str, idempotency_key: str, fencing_token: int, body: str,
                    if_match: int | None, timeout: float | None = None) -> Receipt:
        """POST /tickets/{id}/comments with the comment's own key, conditional on ``if_match``
        (the ticket version the comment was approved against). Returns a :class:`Receipt` whose
        ``external_id`` is the comment id and ``version`` the ticket's new version. Raises
        ``PreconditionFailed`` (412: the ticket changed — re-read and re-plan) and the table's
        other classes."""
        headers = {"Idempotency-Key": idempotency_key, "X-Fencing-Token": str(fencing_token)}
        if if_match is not None:
            headers["If-Match"] = f'"{if_match}"'
        resp = self._send("POST", f"/tickets/{quote(ticket_id, safe='')}/comments", what="comment",
                          timeout=timeout, json={"body": body}, headers=headers)
        if resp.status_code == 201:
            return self._comment_receipt(json_body(resp, "comment"),
                                         replayed=resp.headers.get("Idempotent-Replayed") == "true")
        raise error_for_status(resp)

    def update_ticket(self, *, ticket_id: str, if_match: int, changes: dict, idempotency_key: str | None = None,
                      fencing_token: int | None = None, timeout: float | None = None) -> Receipt:
        """PATCH /tickets/{id} with ``If-Match: "<if_match>"`` and, for an action, its own
        ``Idempotency-Key`` and ``X-Fencing-Token``. Returns a :class:`Receipt` (kind ``update``)
        whose body is the ticket at its new version. Raises ``PreconditionFailed`` (412, with
        ``current_version`` in its body) when the ticket moved on, and the table's other classes."""
        headers = {"If-Match": f'"{if_match}"'}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        if fencing_token is not None:
            headers["X-Fencing-Token"] = str(fencing_token)
        resp = self._send("PATCH", f"/tickets/{quote(ticket_id, safe='')}", what="update", timeout=timeout,
                          json=changes, headers=headers)
        if resp.status_code == 200:
            return self._update_receipt(json_body(resp, "update"),
                                        replayed=resp.headers.get("Idempotent-Replayed") == "true")
        raise error_for_status(resp)

    def attach(self, *, ticket_id: str, name: str, content_type: str, data: bytes, sha256: str,
               timeout: float | None = None) -> str:
        """PUT /tickets/{id}/attachments/{sha256}: the file's bytes, named ``name`` (sent
        percent-encoded in ``X-Filename``). Idempotent by the digest: a file the ticket already has
        is answered 200 and not stored twice. Returns the service's id of the attachment
        (``<ticket>/<sha256>``); raises the module table's error classes (404: no such ticket;
        400: the bytes do not match the digest)."""
        resp = self._send("PUT", f"/tickets/{quote(ticket_id, safe='')}/attachments/{sha256}", what="attach",
                          timeout=timeout, content=data,
                          headers={"Content-Type": content_type, "X-Filename": quote(name, safe="")})
        if resp.status_code in (200, 201):
            body = json_body(resp, "attach")
            if not isinstance(body, dict) or body.get("sha256") != sha256:
                raise errors.OutcomeUnknown("attach: the answer is not this file's")
            return f"{ticket_id}/{sha256}"
        raise error_for_status(resp)

    def get_ticket(self, *, external_id: str, timeout: float | None = None) -> dict | None:
        """GET /tickets/{id} → the ticket JSON (with ``version``) or None when absent. Raises
        ``DefinitelyNotExecuted``/``OutcomeUnknown`` when the call fails, and the table's class for
        any other status. ``timeout`` (seconds) is bounded by the caller's deadline."""
        resp = self._send("GET", f"/tickets/{quote(external_id, safe='')}", what="read", timeout=timeout)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise error_for_status(resp)
        body = json_body(resp, "read")
        if not isinstance(body, dict):
            raise errors.OutcomeUnknown("read: the answer is not a ticket")
        return body
