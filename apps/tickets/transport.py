"""The HTTP transport the ticket-system connectors share (DESIGN.md §11): one call through the tool
gateway (ADR 0022) with every failure mapped to exactly one class of
:mod:`apps.core.tool_errors` (the table in :mod:`apps.tickets.connectors`), and the readings of an
answer every connector needs — its error class, its JSON, a lookup's result, a ticket's receipt."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from apps.core import tool_errors as errors
from apps.gateway import errors as gateway_errors
from apps.gateway.http import http_request


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


def error_for_status(resp: httpx.Response) -> errors.ToolError:
    try:
        body = resp.json()
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        body = {"raw": resp.text[:200]}
    return error_for(resp.status_code, body)


def json_body(resp: httpx.Response, what: str):
    """The JSON of a success answer. Raises ``OutcomeUnknown`` when it cannot be read: an answer
    that is not JSON (a proxy's page, a cut body) says nothing about what happened."""
    try:
        return resp.json()
    except (ValueError, RecursionError) as exc:
        raise errors.OutcomeUnknown(f"{what}: HTTP {resp.status_code} with a body that is not JSON: {exc!r}") from None


def error_for(code: int, body: dict) -> errors.ToolError:
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


class HttpConnector:
    """Shared transport for the connectors: one call through the tool gateway
    (:func:`apps.gateway.http.http_request`: destination checked, credential injected, answer capped,
    whole-call deadline, outcome recorded), every failure mapped to exactly one error class (the module
    table of :mod:`apps.tickets.connectors`). Subclasses set ``tool`` (the gateway's tool name),
    ``base_url`` and ``timeout``; they never hold a credential."""

    tool: str
    base_url: str
    timeout: float
    #: reuse connections (the gateway's pooled client): only for a server known to set TCP_NODELAY —
    #: against one that writes headers and body in separate packets without it (``http.server``), a
    #: reused connection waits out the peer's delayed ACK, ~40 ms per request
    keep_alive: bool = False

    def _send(self, method: str, path: str, *, what: str, timeout: float | None = None, **kwargs) -> httpx.Response:
        """Send one request to ``base_url + path`` (``timeout`` seconds for the whole call, default the
        connector's; connecting at most 3 s). Raises ``DefinitelyNotExecuted`` when it never left
        (no connection, or a destination the gateway refuses: nothing left the process) and
        ``OutcomeUnknown`` when it was sent and no whole answer came back (a timeout, a dropped
        connection, an answer over the gateway's cap)."""
        t = timeout if timeout is not None else self.timeout
        try:
            return http_request(self.tool, method, self.base_url + path, timeout=t, keep_alive=self.keep_alive,
                                **kwargs)
        except gateway_errors.DestinationRefused as exc:
            raise errors.DefinitelyNotExecuted(f"{what} not sent: the tool gateway refused it ({exc.detail})") from exc
        except gateway_errors.ConnectFailed as exc:
            raise errors.DefinitelyNotExecuted(f"{what} not delivered: {exc.detail}") from exc
        except gateway_errors.ResponseTooLarge as exc:
            raise errors.OutcomeUnknown(f"{what}: HTTP {exc.status}, {exc.detail}", status=exc.status) from exc
        except gateway_errors.GatewayError as exc:
            raise errors.OutcomeUnknown(f"{what}: sent, no answer: {exc.detail}") from exc


def lookup_results(body) -> list:
    """The ``results`` list of a lookup answer. Raises ``OutcomeUnknown`` for an answer without
    one: "nothing found" is only ever read from an answer that says so."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise errors.OutcomeUnknown("lookup: the answer holds no results")
    return results


def lookup_result(body, idempotency_key: str, *, key_field: str, receipt) -> Receipt | None:
    """The answer of a lookup by key, ``{"results": [ticket, ...]}``: None when it found nothing,
    else ``receipt(ticket)`` for the first ticket. Raises ``OutcomeUnknown`` for any other shape or
    a first ticket whose ``key_field`` is not ``idempotency_key``: "nothing found" is only ever read
    from a lookup answer that says so, and another key's ticket is never this key's."""
    results = lookup_results(body)
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


def ticket_receipt(body: dict, *, replayed: bool, connector: str = "reference") -> Receipt:
    """The receipt of a ticket body (``{"id": str, "version": int, "status"?: str, …}``) from the ticket
    system named ``connector``. Raises ``OutcomeUnknown`` when the body is not a ticket (no string id,
    a version that is not a whole number): an answer that cannot be read is no answer."""
    try:
        external_id, version = body["id"], body["version"]
        if not isinstance(external_id, str) or not external_id or isinstance(version, bool):
            raise ValueError(f"id {external_id!r}, version {version!r}")
        version = int(version)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise errors.OutcomeUnknown(f"a malformed ticket in the answer: {exc!r}") from None
    return Receipt(external_id=external_id, version=version, status=body.get("status") or "open", body=body,
                   replayed=replayed, connector=connector)
