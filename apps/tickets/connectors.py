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
409 (stale fencing token) / 412            ``PreconditionFailed``
=========================================  ================================
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

import httpx
from django.conf import settings

from apps.actions import errors


@dataclass(frozen=True)
class Receipt:
    """The ticket system's confirmation of an effect: external id + version + the full body."""

    external_id: str
    version: int
    status: str
    body: dict
    replayed: bool

    def as_dict(self) -> dict:
        return {
            "external_id": self.external_id,
            "version": self.version,
            "status": self.status,
            "replayed": self.replayed,
            "connector": ReferenceTicketConnector.name,
        }


def _error_for_status(resp: httpx.Response) -> errors.ToolError:
    try:
        body = resp.json()
    except ValueError:
        body = {"raw": resp.text[:200]}
    detail = f"HTTP {resp.status_code}: {body.get('error', '')} {body.get('detail', '')}".strip()
    code = resp.status_code
    if code in (400, 422):
        return errors.InvalidParams(detail, status=code, body=body)
    if code in (401, 403):
        return errors.Unauthorized(detail, status=code, body=body)
    if code == 409 and body.get("error") == "request_in_progress":
        # Refused before doing anything; the earlier request's outcome decides. Same key later.
        return errors.TemporarilyUnavailable(detail, status=code, body=body)
    if code in (409, 412):
        return errors.PreconditionFailed(detail, status=code, body=body)
    if code in (429, 503):
        return errors.TemporarilyUnavailable(detail, status=code, body=body)
    return errors.OutcomeUnknown(detail, status=code, body=body)


class ReferenceTicketConnector:
    """The reference ticket service over HTTP: create with ``Idempotency-Key`` and
    ``X-Fencing-Token``, look up by key, get by id."""

    name = "reference"

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None, timeout: float | None = None):
        conf = settings.FAULTDESK
        self.base_url = (base_url or conf["REFSERVICE_URL"]).rstrip("/")
        self.api_key = api_key if api_key is not None else conf["REFSERVICE_API_KEY"]
        self.timeout = timeout if timeout is not None else conf["REFSERVICE_TIMEOUT_SECONDS"]

    def _client(self, timeout: float | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        t = timeout if timeout is not None else self.timeout
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(t, connect=min(t, 3.0)))

    def create_ticket(self, *, idempotency_key: str, fencing_token: int, params: dict,
                      timeout: float | None = None) -> Receipt:
        """POST /tickets. Returns a :class:`Receipt`; raises a :class:`~apps.actions.errors.ToolError`
        subclass per the module table. ``timeout`` (seconds) is bounded by the caller's deadline."""
        try:
            with self._client(timeout) as client:
                resp = client.post(
                    "/tickets",
                    json=params,
                    headers={"Idempotency-Key": idempotency_key, "X-Fencing-Token": str(fencing_token)},
                )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise errors.DefinitelyNotExecuted(f"not delivered: {exc!r}") from exc
        except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise errors.OutcomeUnknown(f"sent, no answer: {exc!r}") from exc
        if resp.status_code in (200, 201):
            body = resp.json()
            return Receipt(
                external_id=body["id"],
                version=int(body["version"]),
                status=body.get("status", "open"),
                body=body,
                replayed=resp.headers.get("Idempotent-Replayed") == "true",
            )
        raise _error_for_status(resp)

    def lookup_by_key(self, *, idempotency_key: str) -> Receipt | None:
        """GET /tickets?idempotency_key=… → the ticket created with that key, or None.
        Raises ``OutcomeUnknown``/``DefinitelyNotExecuted`` when the lookup itself fails."""
        try:
            with self._client() as client:
                resp = client.get("/tickets", params={"idempotency_key": idempotency_key})
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise errors.DefinitelyNotExecuted(f"lookup not delivered: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise errors.OutcomeUnknown(f"lookup failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise _error_for_status(resp)
        results = resp.json().get("results", [])
        if not results:
            return None
        body = results[0]
        return Receipt(external_id=body["id"], version=int(body["version"]), status=body.get("status", "open"),
                       body=body, replayed=True)

    def fence(self, *, idempotency_key: str, fencing_token: int) -> Receipt | None:
        """POST /fences: raise the key's fencing token at the remote to ``fencing_token`` and
        look the key up in the same remote transaction. Returns the ticket created with the key
        as a :class:`Receipt`, or None — and then no request carrying a lower token can ever
        create one (DESIGN.md §6: "not executed" is only recorded after this).

        Raises ``PreconditionFailed`` (409) when a higher token already reached the remote (the
        caller is stale), ``DefinitelyNotExecuted``/``OutcomeUnknown`` when the call fails."""
        try:
            with self._client() as client:
                resp = client.post(
                    "/fences", headers={"Idempotency-Key": idempotency_key, "X-Fencing-Token": str(fencing_token)}
                )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise errors.DefinitelyNotExecuted(f"fence not delivered: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise errors.OutcomeUnknown(f"fence failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise _error_for_status(resp)
        body = resp.json().get("ticket")
        if body is None:
            return None
        return Receipt(external_id=body["id"], version=int(body["version"]), status=body.get("status", "open"),
                       body=body, replayed=True)

    def get_ticket(self, *, external_id: str) -> dict | None:
        """GET /tickets/{id} → the ticket JSON (with ``version``) or None when absent. Raises
        ``DefinitelyNotExecuted``/``OutcomeUnknown`` when the call fails, and the table's class for
        any other status."""
        try:
            with self._client() as client:
                resp = client.get(f"/tickets/{quote(external_id, safe='')}")
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise errors.DefinitelyNotExecuted(f"read not delivered: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise errors.OutcomeUnknown(f"read failed: {exc!r}") from exc
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise _error_for_status(resp)
        return resp.json()


def connector_for(tool: str) -> ReferenceTicketConnector:
    """The connector that executes ``tool`` (only ``ticket.create`` on the reference service now)."""
    if tool == "ticket.create":
        return ReferenceTicketConnector()
    raise KeyError(f"no connector for tool {tool!r}")
