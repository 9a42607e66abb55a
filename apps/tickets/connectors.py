"""Connectors to external ticket systems (DESIGN.md §11). The tool gateway injects credentials;
nothing here is visible to the model.

Every transport or HTTP failure is mapped to exactly one class of :mod:`apps.actions.errors`:

=========================================  ================================
what happened                              error class
=========================================  ================================
connection refused / connect timeout       ``DefinitelyNotExecuted``
read timeout, dropped connection, 5xx      ``OutcomeUnknown``
503 / 429                                  ``TemporarilyUnavailable``
400 / 422                                  ``InvalidParams``
401 / 403                                  ``Unauthorized``
409 (request with the key in progress)     ``TemporarilyUnavailable``
409 (stale fencing token) / 412 / 404       ``PreconditionFailed``
=========================================  ================================
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from urllib.parse import quote

import httpx
from django.conf import settings

from apps.core import tool_errors as errors
from config.tls import tls_context


@dataclass(frozen=True)
class Receipt:
    """The ticket system's confirmation of an effect: external id + version + the full body, and
    the connector (``"reference"`` or ``"helpdesk"``) that reported it."""

    external_id: str
    version: int
    status: str
    body: dict
    replayed: bool
    connector: str = "reference"
    #: what was written: ``"ticket"`` (a create), ``"comment"`` or ``"update"``
    kind: str = "ticket"
    #: the ticket the write is on (for a create: ``external_id``); ``version`` is that ticket's
    #: version after the write
    ticket_id: str = ""

    def as_dict(self) -> dict:
        d = {
            "external_id": self.external_id,
            "version": self.version,
            "status": self.status,
            "replayed": self.replayed,
            "connector": self.connector,
        }
        if self.kind != "ticket":
            d.update(kind=self.kind, ticket_id=self.ticket_id)
        return d


def _error_for_status(resp: httpx.Response) -> errors.ToolError:
    try:
        body = resp.json()
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        body = {"raw": resp.text[:200]}
    return _error_for(resp.status_code, body)


def _json_body(resp: httpx.Response, what: str):
    """The JSON of a success answer. Raises ``OutcomeUnknown`` when it cannot be read: an answer
    that is not JSON (a proxy's page, a cut body) says nothing about what happened."""
    try:
        return resp.json()
    except (ValueError, RecursionError) as exc:
        raise errors.OutcomeUnknown(f"{what}: HTTP {resp.status_code} with a body that is not JSON: {exc!r}") from None


def _error_for(code: int, body: dict) -> errors.ToolError:
    """The module table's error class for an answer with status ``code`` and JSON ``body``."""
    detail = f"HTTP {code}: {body.get('error', '')} {body.get('detail', '')}".strip()
    if code in (400, 422):
        return errors.InvalidParams(detail, status=code, body=body)
    if code in (401, 403):
        return errors.Unauthorized(detail, status=code, body=body)
    if code == 409 and body.get("error") == "request_in_progress":
        # Refused before doing anything; the earlier request's outcome decides. Same key later.
        return errors.TemporarilyUnavailable(detail, status=code, body=body)
    if code in (409, 412) or (code == 404 and body.get("error") == "not_found"):
        # 404: a write on a ticket that does not exist (any more) — definite, nothing written.
        return errors.PreconditionFailed(detail, status=code, body=body)
    if code in (429, 503):
        return errors.TemporarilyUnavailable(detail, status=code, body=body)
    return errors.OutcomeUnknown(detail, status=code, body=body)


#: base URLs of reference services this process found without ``POST /ticket-batches`` (404/405)
_NO_BATCH_ENDPOINT: set[str] = set()

#: one client per process, ticket system and credential (see :func:`_pooled_client`)
_CLIENTS: dict[tuple, httpx.Client] = {}
_CLIENTS_LOCK = threading.Lock()


def _pooled_client(base_url: str, headers: dict[str, str], *, keep_alive: bool = False) -> httpx.Client:
    """The process's shared ``httpx.Client`` for ``base_url`` with ``headers`` (thread-safe; a
    child process after a fork gets its own), instead of a new client per request.

    ``keep_alive`` False: each request opens and closes its own connection. Against a server that
    writes a response's headers and body in separate packets without TCP_NODELAY (``http.server``,
    Django's development server), a reused connection waits out the peer's delayed ACK, about 40 ms
    per request. ``keep_alive`` True reuses idle connections (as many as the outbox's sender threads,
    ``OUTBOX_SEND_CONCURRENCY``) for 5 s (well under the reference service's 60 s idle timeout, so a
    connection is not reused as the server drops it):
    a request to a server that sets TCP_NODELAY costs about a third of the CPU and wall time
    (docs/performance.md). A pooled connection the server closed is seen before reuse and dropped;
    a request on one that closes mid-request is ``OutcomeUnknown``, as any lost answer is."""
    key = (os.getpid(), base_url, tuple(sorted(headers.items())), id(tls_context()), keep_alive)
    client = _CLIENTS.get(key)
    if client is None:
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                if len(_CLIENTS) >= 32:  # remotes come and go (a reconfigured URL, a test's server)
                    for stale in _CLIENTS.values():
                        stale.close()
                    _CLIENTS.clear()
                width = max(1, settings.FAULTDESK["OUTBOX_SEND_CONCURRENCY"])
                limits = httpx.Limits(max_connections=width, max_keepalive_connections=width if keep_alive else 0,
                                      keepalive_expiry=5.0)
                client = httpx.Client(base_url=base_url, headers=headers, verify=tls_context(), limits=limits)
                _CLIENTS[key] = client
    return client


class _HttpConnector:
    """Shared transport for the connectors: one call, every transport failure mapped to exactly
    one error class (the module table). Subclasses set ``base_url``, ``timeout`` and
    ``_headers()``."""

    base_url: str
    timeout: float
    #: reuse connections (see :func:`_pooled_client`): only for a server known to set TCP_NODELAY
    keep_alive: bool = False

    def _headers(self) -> dict[str, str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _send(self, method: str, path: str, *, what: str, timeout: float | None = None, **kwargs) -> httpx.Response:
        """Send one request (``timeout`` seconds, default the connector's; connecting at most 3 s).
        Raises ``DefinitelyNotExecuted`` when it never reached the remote and ``OutcomeUnknown``
        when it was sent and no answer came back."""
        t = timeout if timeout is not None else self.timeout
        client = _pooled_client(self.base_url, self._headers(), keep_alive=self.keep_alive)
        try:
            return client.request(method, path, timeout=httpx.Timeout(t, connect=min(t, 3.0)), **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise errors.DefinitelyNotExecuted(f"{what} not delivered: {exc!r}") from exc
        except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise errors.OutcomeUnknown(f"{what}: sent, no answer: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise errors.OutcomeUnknown(f"{what} failed: {exc!r}") from exc


def _ticket_for_key(body: dict, idempotency_key: str, *, replayed: bool) -> Receipt:
    """The receipt of a ticket the reference service returned for ``idempotency_key``. Raises
    ``OutcomeUnknown`` when the ticket names another key: an answer that is not this request's
    (a misbehaving proxy or connection) must never become its receipt — the reconciler looks the
    key up instead."""
    if not isinstance(body, dict) or body.get("idempotency_key") != idempotency_key:
        found = body.get("idempotency_key") if isinstance(body, dict) else None
        raise errors.OutcomeUnknown(f"the answer is for another idempotency key ({found!r}), not this request's")
    return _ticket_receipt(body, replayed=replayed)


def _lookup_result(body, idempotency_key: str, *, key_field: str, receipt) -> Receipt | None:
    """The answer of a lookup by key, ``{"results": [ticket, ...]}``: None when it found nothing,
    else ``receipt(ticket)`` for the first ticket. Raises ``OutcomeUnknown`` for any other shape or
    a first ticket whose ``key_field`` is not ``idempotency_key``: "nothing found" is only ever read
    from a lookup answer that says so, and another key's ticket is never this key's."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise errors.OutcomeUnknown("lookup: the answer holds no results")
    if not results:
        return None
    first = results[0]
    if not isinstance(first, dict) or first.get(key_field) != idempotency_key:
        found = first.get(key_field) if isinstance(first, dict) else None
        raise errors.OutcomeUnknown(f"lookup: the answer is for another idempotency key ({found!r})")
    try:
        return receipt(first)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise errors.OutcomeUnknown(f"lookup: a malformed ticket in the answer: {exc!r}") from None


def _ticket_receipt(body: dict, *, replayed: bool) -> Receipt:
    """The receipt of a ticket body. Raises ``OutcomeUnknown`` when the body is not a ticket (no
    string id, a version that is not a whole number): an answer that cannot be read is no answer."""
    try:
        external_id, version = body["id"], body["version"]
        if not isinstance(external_id, str) or not external_id or isinstance(version, bool):
            raise ValueError(f"id {external_id!r}, version {version!r}")
        version = int(version)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise errors.OutcomeUnknown(f"a malformed ticket in the answer: {exc!r}") from None
    return Receipt(external_id=external_id, version=version, status=body.get("status", "open"), body=body,
                   replayed=replayed)


class ReferenceTicketConnector(_HttpConnector):
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

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None, timeout: float | None = None):
        conf = settings.FAULTDESK
        self.base_url = (base_url or conf["REFSERVICE_URL"]).rstrip("/")
        self.api_key = api_key if api_key is not None else conf["REFSERVICE_API_KEY"]
        self.timeout = timeout if timeout is not None else conf["REFSERVICE_TIMEOUT_SECONDS"]
        self.keep_alive = conf["REFSERVICE_KEEPALIVE"]

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def create_ticket(self, *, idempotency_key: str, fencing_token: int, params: dict,
                      timeout: float | None = None) -> Receipt:
        """POST /tickets. Returns a :class:`Receipt`; raises a :class:`~apps.actions.errors.ToolError`
        subclass per the module table. ``timeout`` (seconds) is bounded by the caller's deadline."""
        resp = self._send("POST", "/tickets", what="create", timeout=timeout, json=params,
                          headers={"Idempotency-Key": idempotency_key, "X-Fencing-Token": str(fencing_token)})
        if resp.status_code in (200, 201):
            return _ticket_for_key(_json_body(resp, "create"), idempotency_key,
                                   replayed=resp.headers.get("Idempotent-Replayed") == "true")
        raise _error_for_status(resp)

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
        body = {"items": [{"idempotency_key": key, "fencing_token": token, "ticket": params}
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
            return [_error_for_status(resp)] * len(items)
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

    #: the refusals ``POST /ticket-batches`` gives an item (what ``POST /tickets`` answers before or
    #: instead of creating: invalid, key in progress or fenced, key reused, unavailable); any other
    #: item status is not a refusal this connector can trust
    _BATCH_ITEM_REFUSALS = frozenset({400, 409, 422, 503})

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
            if status not in ReferenceTicketConnector._BATCH_ITEM_REFUSALS or result.get("ticket") is not None:
                # a status the endpoint never gives an item, or a refusal that carries a ticket
                raise ValueError(f"status {status} with ticket {result.get('ticket')!r}")
            return _error_for(status, result)
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
            raise _error_for_status(resp)
        return _lookup_result(_json_body(resp, "lookup"), idempotency_key, key_field="idempotency_key",
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
            raise _error_for_status(resp)
        data = _json_body(resp, "fence")
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
            raise _error_for_status(resp)
        body = _json_body(resp, "lookup")
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise errors.OutcomeUnknown("lookup: the answer holds no results")
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
            return self._comment_receipt(_json_body(resp, "comment"),
                                         replayed=resp.headers.get("Idempotent-Replayed") == "true")
        raise _error_for_status(resp)

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
            return self._update_receipt(_json_body(resp, "update"),
                                        replayed=resp.headers.get("Idempotent-Replayed") == "true")
        raise _error_for_status(resp)

    def get_ticket(self, *, external_id: str, timeout: float | None = None) -> dict | None:
        """GET /tickets/{id} → the ticket JSON (with ``version``) or None when absent. Raises
        ``DefinitelyNotExecuted``/``OutcomeUnknown`` when the call fails, and the table's class for
        any other status. ``timeout`` (seconds) is bounded by the caller's deadline."""
        resp = self._send("GET", f"/tickets/{quote(external_id, safe='')}", what="read", timeout=timeout)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise _error_for_status(resp)
        body = _json_body(resp, "read")
        if not isinstance(body, dict):
            raise errors.OutcomeUnknown("read: the answer is not a ticket")
        return body


HELPDESK_PRIORITY = {"P1": 1, "P2": 2, "P3": 3, "P4": 4}
HELPDESK_STATUS = {1: "open", 2: "reopened", 3: "resolved", 4: "closed", 5: "duplicate"}


class HelpdeskConnector(_HttpConnector):
    """django-helpdesk 2.6 over its REST API (``Authorization: Token``), DESIGN.md §11.

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

    def __init__(self, *, base_url: str | None = None, token: str | None = None, timeout: float | None = None):
        conf = settings.FAULTDESK
        self.base_url = (base_url or conf["HELPDESK_URL"]).rstrip("/")
        self.token = token if token is not None else conf["HELPDESK_API_TOKEN"]
        self.timeout = timeout if timeout is not None else conf["HELPDESK_TIMEOUT_SECONDS"]
        self.queue_id = conf["HELPDESK_QUEUE_ID"]
        self.request_lifetime_seconds = conf["HELPDESK_REQUEST_LIFETIME_SECONDS"]

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Token {self.token}"}

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
        resp = self._send("POST", "/helpdesk/api/tickets/", what="create", timeout=timeout, json=payload)
        if resp.status_code == 201:
            return self._receipt(_json_body(resp, "create"), replayed=False)
        if resp.status_code == 409:
            found = self.lookup_by_key(idempotency_key=idempotency_key)
            if found is not None:
                return found
        raise _error_for_status(resp)

    def lookup_by_key(self, *, idempotency_key: str) -> Receipt | None:
        """The ticket whose ``faultdesk_key`` is the key (bridge view), or None."""
        resp = self._send("GET", "/helpdesk/api/faultdesk/tickets/by-custom-field/", what="lookup",
                          params={"field": "faultdesk_key", "value": idempotency_key})
        if resp.status_code != 200:
            raise _error_for_status(resp)
        return _lookup_result(_json_body(resp, "lookup"), idempotency_key, key_field="custom_faultdesk_key",
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

    def get_ticket(self, *, external_id: str, timeout: float | None = None) -> dict | None:
        """The ticket JSON by id (bridge view), with ``idempotency_key`` set from
        ``custom_faultdesk_key``; None when absent. ``timeout`` as for the reference service."""
        if not external_id.isdigit():
            return None
        resp = self._send("GET", f"/helpdesk/api/faultdesk/tickets/{external_id}/", what="read", timeout=timeout)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise _error_for_status(resp)
        body = _json_body(resp, "read")
        if not isinstance(body, dict) or "id" not in body:
            raise errors.OutcomeUnknown("read: the answer is not a ticket")
        return {**body, "id": str(body["id"]), "version": 1, "status": HELPDESK_STATUS.get(body.get("status")),
                "idempotency_key": body.get("custom_faultdesk_key") or None}


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
