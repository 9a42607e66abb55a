"""HTTP/1.1 to the ticket systems: the standard library's ``http.client``, with a per-process pool of
kept-alive connections and exactly two ways to fail (DESIGN.md §6, §11; the connectors' module table).

- :class:`NotSent`: the request never left — the connection could not be made (refused, timed out,
  no route, name not found, TLS handshake failed). The remote cannot have acted on it.
- :class:`NoAnswer`: the request was, or may have been, sent and no whole response came back (a
  read timeout, a connection dropped or reset, a malformed or oversized response). The remote may
  have acted on it; the caller reconciles by idempotency key.

Why not httpx, which the rest of faultdesk uses: a request to a ticket system costs about 410 µs
of CPU through ``httpx.Client`` and 120 µs through ``http.client`` (kept-alive, loopback, this
machine), and the outbox drain's budget at its target rate is about 500 µs per message for
everything the dispatcher does (docs/performance.md). The pool's own logic is what httpx's
connection pool does for these calls, and no more: reuse an idle connection only after checking the
peer has not closed it, never reuse one after an error or a response that closes it, keep idle
connections at most ``idle_seconds``.

Unlike httpx, the pool does not read ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` from the
environment: a ticket system is reached at the address configured for it (``REFSERVICE_URL``,
``HELPDESK_URL``), or through a proxy written there as that address. Redirects are not followed
(nor were they with httpx's default).

A reused connection the peer closes at the very moment a request goes out gives :class:`NoAnswer`
(the request may have reached it), as any lost answer does; the idempotency key makes the next
attempt safe."""

from __future__ import annotations

import http.client
import json as jsonlib
import logging
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from email.message import Message
from urllib.parse import urlencode, urlsplit

from config.tls import tls_context

log = logging.getLogger(__name__)

#: the largest response body read (bytes): a larger one is :class:`NoAnswer` (the call may have acted)
MAX_RESPONSE_BYTES = 16 * 1024 * 1024


class TransportError(Exception):
    """A request to a ticket system that did not come back with a response."""


class NotSent(TransportError):
    """The request never left: no connection could be made. The remote cannot have acted on it."""


class NoAnswer(TransportError):
    """The request was (or may have been) sent, and no whole response came back."""


@dataclass(frozen=True)
class Response:
    """A whole response: ``status_code``, ``headers`` (case-insensitive ``get``), ``content`` (bytes)."""

    status_code: int
    headers: Message
    content: bytes

    def json(self):
        """The body parsed as JSON. Raises ``ValueError`` when it is not JSON."""
        return jsonlib.loads(self.content)

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")


class Pool:
    """Connections to one origin (``base_url``: ``http://`` or ``https://``, optionally with a path
    prefix), sending ``headers`` with every request. Thread-safe: each request takes an idle
    connection or opens one, and gives it back when its response was read whole and the response
    does not close it. ``keep_alive`` False: every request opens its own connection and asks the
    peer to close it (``Connection: close``), for a peer that must not see kept-alive connections."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, *, keep_alive: bool = True,
                 max_idle: int = 32, idle_seconds: float = 5.0):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.headers = dict(headers or {})
        self.keep_alive = keep_alive
        self.max_idle = max_idle
        self.idle_seconds = idle_seconds
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, *, params: dict | None = None, json=None,
                headers: dict[str, str] | None = None, timeout: float = 5.0,
                connect_timeout: float | None = None) -> Response:
        """Send ``method`` ``path`` (below the base URL's path) with ``params`` as the query string
        and ``json`` as a JSON body (UTF-8); ``headers`` are added to the pool's. ``timeout``
        (seconds) bounds each wait for the peer once connected, ``connect_timeout`` (default
        ``timeout``) the connection. Returns the :class:`Response`; raises :class:`NotSent` or
        :class:`NoAnswer`."""
        target = self.prefix + path
        if params:
            target += ("&" if "?" in target else "?") + urlencode(params)
        body = None
        send_headers = {**self.headers, **(headers or {})}
        if json is not None:
            body = jsonlib.dumps(json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
            send_headers.setdefault("Content-Type", "application/json")
        if not self.keep_alive:
            send_headers["Connection"] = "close"
        if _tracer is not None:
            return self._traced(method, target, body, send_headers, timeout, connect_timeout)
        return self._send(method, target, body, send_headers, timeout, connect_timeout)

    def _traced(self, method, target, body, headers, timeout, connect_timeout) -> Response:
        """:meth:`_send` inside a CLIENT span (tracing on: :func:`instrument`), its context sent on."""
        from opentelemetry import propagate, trace

        url = f"{'https' if self.https else 'http'}://{self.host}:{self.port}{target}"
        with _tracer.start_as_current_span(method, kind=trace.SpanKind.CLIENT, attributes={
                "http.request.method": method, "url.full": url, "server.address": self.host,
                "server.port": self.port}) as span:
            propagate.inject(headers)
            response = self._send(method, target, body, headers, timeout, connect_timeout)
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 400:
                span.set_status(trace.StatusCode.ERROR)
            return response

    def _send(self, method, target, body, send_headers, timeout, connect_timeout) -> Response:
        conn = self._idle_connection() if self.keep_alive else None
        if conn is None:
            conn = self._connect(connect_timeout if connect_timeout is not None else timeout)
        try:
            conn.sock.settimeout(timeout)
            conn.request(method, target, body=body, headers=send_headers)
            response = conn.getresponse()
            if response.status < 200:  # 101 (never asked for): what follows is not HTTP any more
                raise http.client.HTTPException(f"interim status {response.status} as the answer")
            content = _body(response)
        except (OSError, http.client.HTTPException, _TooLarge) as exc:
            conn.close()
            raise NoAnswer(f"{method} {target}: {exc!r}") from exc
        if self.keep_alive and not response.will_close:
            self._give_back(conn)
        else:
            conn.close()
        log.info('HTTP Request: %s %s://%s:%d%s "HTTP/1.1 %d %s"', method, "https" if self.https else "http",
                 self.host, self.port, target, response.status, response.reason)
        return Response(status_code=response.status, headers=response.msg, content=content)

    def close(self) -> None:
        """Close the idle connections (requests in progress keep theirs)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.https:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=tls_context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.response_class = _FinalResponse
        try:
            conn.connect()  # sets TCP_NODELAY: a request's headers and body do not wait for an ACK
        except (OSError, ssl.SSLError) as exc:  # refused, timed out, unreachable, not resolved, TLS
            conn.close()
            raise NotSent(f"connecting to {self.host}:{self.port}: {exc!r}") from exc
        return conn

    def _idle_connection(self) -> http.client.HTTPConnection | None:
        """An idle connection the peer has not closed, or None. An expired or closed one is dropped."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn, since = self._idle.pop()
            if now - since <= self.idle_seconds and _still_open(conn.sock):
                return conn
            conn.close()

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()


#: the tracer of outbound calls while tracing is on (:func:`instrument`), else None
_tracer = None


def instrument(tracer_provider) -> None:
    """Make a CLIENT span for every request (``http.request.method``, ``url.full``,
    ``http.response.status_code``; an exception is recorded on it) and send its trace context
    with the request. Called by :func:`config.tracing.setup_tracing`."""
    global _tracer
    from opentelemetry import trace

    _tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)


def uninstrument() -> None:
    """Undo :func:`instrument`."""
    global _tracer
    _tracer = None


class _FinalResponse(http.client.HTTPResponse):
    """A response that reads past every interim (1xx) answer to the final one. ``http.client``
    skips only ``100 Continue``: a ``102 Processing`` or ``103 Early Hints`` would be returned as
    the answer, and the real one, still on its way, read by the next request to take the
    connection — another request's ticket as its receipt."""

    def _read_status(self):
        for _ in range(_MAX_INTERIM):
            version, status, reason = super()._read_status()
            if not 100 < status < 200 or status == 101:  # 100 is skipped by begin(), 101 is refused
                return version, status, reason
            http.client._read_headers(self.fp)  # the interim answer's headers
        raise http.client.HTTPException(f"more than {_MAX_INTERIM} interim answers")


#: interim (1xx) answers read past before the peer is taken to be misbehaving
_MAX_INTERIM = 16


class _TooLarge(Exception):
    def __init__(self):
        super().__init__(f"response larger than {MAX_RESPONSE_BYTES} bytes")


def _body(response: http.client.HTTPResponse) -> bytes:
    """The whole body of ``response``, at most :data:`MAX_RESPONSE_BYTES`. Raises ``IncompleteRead``
    when the peer closed before the end it announced (``Content-Length`` or chunks), ``_TooLarge``."""
    if response.length is not None:  # Content-Length: read() raises IncompleteRead when it falls short
        if response.length > MAX_RESPONSE_BYTES:
            raise _TooLarge()
        return response.read()
    parts, total = [], 0  # chunked, or delimited by the peer closing
    while chunk := response.read(65536):
        total += len(chunk)
        if total > MAX_RESPONSE_BYTES:
            raise _TooLarge()
        parts.append(chunk)
    return b"".join(parts)


def _still_open(sock: socket.socket | None) -> bool:
    """Whether an idle connection's socket can take a request: it is there and nothing is readable
    on it (an idle HTTP/1.1 connection has nothing to read; readable means the peer closed it, reset
    it, or sent something unasked — either way it is not reused)."""
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False
