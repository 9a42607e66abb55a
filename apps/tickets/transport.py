"""The HTTP transport the ticket-system connectors share (DESIGN.md §11): a pooled client per
process and remote, one call with every transport failure mapped to exactly one class of
:mod:`apps.core.tool_errors` (the table in :mod:`apps.tickets.connectors`), and the readings of an
answer every connector needs — its error class, its JSON, a lookup's result, a ticket's receipt."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

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


#: one client per process, ticket system and credential (see :func:`pooled_client`)
_CLIENTS: dict[tuple, httpx.Client] = {}
_CLIENTS_LOCK = threading.Lock()


def pooled_client(base_url: str, headers: dict[str, str], *, keep_alive: bool = False) -> httpx.Client:
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


class HttpConnector:
    """Shared transport for the connectors: one call, every transport failure mapped to exactly
    one error class (the module table). Subclasses set ``base_url``, ``timeout`` and
    ``_headers()``."""

    base_url: str
    timeout: float
    #: reuse connections (see :func:`pooled_client`): only for a server known to set TCP_NODELAY
    keep_alive: bool = False

    def _headers(self) -> dict[str, str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _send(self, method: str, path: str, *, what: str, timeout: float | None = None, **kwargs) -> httpx.Response:
        """Send one request (``timeout`` seconds, default the connector's; connecting at most 3 s).
        Raises ``DefinitelyNotExecuted`` when it never reached the remote and ``OutcomeUnknown``
        when it was sent and no answer came back."""
        t = timeout if timeout is not None else self.timeout
        client = pooled_client(self.base_url, self._headers(), keep_alive=self.keep_alive)
        try:
            return client.request(method, path, timeout=httpx.Timeout(t, connect=min(t, 3.0)), **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise errors.DefinitelyNotExecuted(f"{what} not delivered: {exc!r}") from exc
        except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise errors.OutcomeUnknown(f"{what}: sent, no answer: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise errors.OutcomeUnknown(f"{what} failed: {exc!r}") from exc


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
