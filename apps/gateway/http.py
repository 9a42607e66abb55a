"""HTTP through the tool gateway (ADR 0022; spec agent-execution-system.md §16.6): one function,
:func:`http_request`, for every HTTP call faultdesk makes out of its process.

For each call it

1. checks the destination (scheme, host, port of the URL) against the tool's list
   (:func:`apps.gateway.tools.allowed_destinations`) *before* any socket is opened — and once more
   at the socket, where the connection is made (:class:`_GuardedBackend`): a refused destination is
   :class:`~apps.gateway.errors.DestinationRefused`, recorded, and nothing leaves the process;
2. injects the tool's credential (:func:`apps.gateway.credentials.authorization`), which the caller
   never sees — a credential that cannot travel in a header (a line break, a character outside
   ASCII: a mounted file holding two keys) is refused before anything is sent (``bad_credential``);
3. sends without following redirects (a 3xx is an answer: outcome ``redirect``), without
   environment proxies or ``.netrc`` (``trust_env`` off), over one pooled client per process and tool
   (keep-alive where the caller asks for it) with the process's TLS context (``config.tls``);
4. bounds the whole call by its deadline (``timeout`` seconds from the start): every connect, TLS
   handshake, write and read of the call waits at most the time left (:class:`_GuardedStream`), so a
   server that trickles its headers or its body is cut at the deadline (``timeout``), not after a
   per-read timeout per byte;
5. streams the answer and stops reading past the tool's cap (``too_large``): it is never buffered
   whole, and a compressed answer (which it did not ask for) is inflated a bounded step at a time,
   the cap counting decoded bytes (:mod:`apps.gateway.decoding`); an answer that echoes the
   credential back, in any spelling the caller could decode, has it replaced by ``[redacted]``
   before the caller sees it (:mod:`apps.gateway.redaction`), and so has the message of any error;
6. records the outcome class (:func:`apps.gateway.records.call_record`).

The answer comes back as an ``httpx.Response`` whose body is already read (at most the cap); failures
raise the classes of :mod:`apps.gateway.errors`.
"""

from __future__ import annotations

import os
import re
import threading
import time
import zlib
from dataclasses import dataclass, field

import httpcore
import httpx
from django.conf import settings
from django.utils import timezone

from apps.gateway import credentials, resolver, spans, tools
from apps.gateway.decoding import TooLarge, UnsupportedEncoding, decoded
from apps.gateway.destinations import Destination, destination_of
from apps.gateway.errors import (
    CallTimedOut,
    ConnectFailed,
    DestinationRefused,
    GatewayError,
    ResponseTooLarge,
    TransportFailed,
)
from apps.gateway.records import call_record
from apps.gateway.redaction import every_credential, holds_data, scrub, scrub_body, scrub_data
from config.tls import tls_context

#: headers of the streamed answer that no longer hold for the body handed back (read, decoded)
_HOP_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})
#: a header value HTTP can carry: visible ASCII, spaces and tabs inside, none around it (RFC 9110 §5.5)
_HEADER_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e\t]*[\x21-\x7e])?")


@dataclass
class _Call:
    """The call in progress on this thread: its deadline (``time.monotonic()``), where its sockets
    may connect, and whether one was refused there."""

    deadline: float
    hosts: frozenset[tuple[str, int]]
    refused: list[str] = field(default_factory=list)


_local = threading.local()


def _current() -> _Call | None:
    return getattr(_local, "call", None)


def _bounded(timeout: float | None, exc: type[Exception]) -> float | None:
    """``timeout`` shortened to the time left before the current call's deadline; raises ``exc``
    when none is left."""
    call = _current()
    if call is None:
        return timeout
    left = call.deadline - time.monotonic()
    if left <= 0:
        raise exc("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _GuardedStream(httpcore.NetworkStream):
    """A connection whose every wait is bounded by the deadline of the call using it (the call of the
    thread that reads or writes: a pooled connection serves one call at a time)."""

    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _GuardedStream(self._inner.start_tls(ssl_context, server_hostname,
                                                    _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _GuardedBackend(httpcore.NetworkBackend):
    """The sockets of the gateway's clients: a connection is made only for a call in progress on this
    thread and only to a host and port that call may reach (the second check, where the socket is
    opened); its waits are bounded by the call's deadline."""

    def __init__(self):
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        call = _current()
        if call is None or (host.lower().strip("[]"), port) not in call.hosts:
            if call is not None:
                call.refused.append(f"{host}:{port}")
            raise httpcore.ConnectError(f"the tool gateway does not connect to {host}:{port}")
        try:  # the name lookup too is bounded by the call's deadline
            found = resolver.addresses(host, port, _bounded(timeout, httpcore.ConnectTimeout))
        except resolver.LookupTimedOut as exc:
            raise httpcore.ConnectTimeout(str(exc)) from None
        except resolver.LookupFailed as exc:
            raise httpcore.ConnectError(str(exc)) from None
        failure: Exception | None = None
        for address in found:  # each address in turn, as socket.create_connection does
            try:
                stream = self._inner.connect_tcp(address, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                 local_address, socket_options)
            except httpcore.ConnectError as exc:
                failure = exc
                continue
            return _GuardedStream(stream)
        raise failure

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        raise httpcore.ConnectError("the tool gateway does not connect to unix sockets")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


_BACKEND = _GuardedBackend()
_CLIENTS: dict[tuple, httpx.Client] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(tool: str, keep_alive: bool) -> httpx.Client:
    """The process's client for ``tool`` (one per process, tool, keep-alive choice and TLS context;
    a child process after a fork makes its own). Credentials are per request, never on the client.

    ``keep_alive`` False: each request opens and closes its own connection (against a server that
    writes headers and body in separate packets without TCP_NODELAY a reused connection waits out
    the peer's delayed ACK, ~40 ms). True: up to ``OUTBOX_SEND_CONCURRENCY`` idle connections are
    kept for 5 s (under the reference service's 60 s idle timeout); a pooled connection the server
    closed is seen before reuse and dropped."""
    width = max(1, settings.FAULTDESK["OUTBOX_SEND_CONCURRENCY"])
    ctx = tls_context()
    key = (os.getpid(), tool, keep_alive, id(ctx), width)
    client = _CLIENTS.get(key)
    if client is None:
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                if len(_CLIENTS) >= 32 or any(k[0] != key[0] for k in _CLIENTS):
                    for k in list(_CLIENTS):  # settings come and go (tests); a parent's clients are the parent's
                        stale = _CLIENTS.pop(k)
                        if k[0] == key[0]:
                            stale.close()
                transport = httpx.HTTPTransport(verify=ctx, trust_env=False)
                transport._pool = httpcore.ConnectionPool(  # the same pool, on the guarded sockets
                    ssl_context=ctx, max_connections=width, max_keepalive_connections=width if keep_alive else 0,
                    keepalive_expiry=5.0, network_backend=_BACKEND)
                client = httpx.Client(transport=transport, trust_env=False, follow_redirects=False)
                _CLIENTS[key] = client
    return client


#: the tools whose requests carry text a model reads (a prompt, texts to embed): no credential of any
#: tool may be in them (spec §16.6: "凭证由网关注入而非放进模型上下文")
_NEVER_HANDED_A_CREDENTIAL = frozenset({tools.MODEL, tools.EMBEDDINGS})


def _without_credentials(json_body, content):
    """The request's ``json`` and ``content`` with every tool's credential (a device alert or a ticket
    comment may quote one) replaced by ``[redacted]``; unchanged when they hold none."""
    values = every_credential()
    for value in values:
        if json_body is not None and holds_data(json_body, value):
            json_body = scrub_data(json_body, value)
        if isinstance(content, str):
            content = scrub(content, value)
        elif isinstance(content, bytes):
            text = content.decode("utf-8", "replace")
            cleaned = scrub(text, value)
            content = content if cleaned == text else cleaned.encode("utf-8")
    return json_body, content


def _scrubbed(text: str, secrets: list[str]) -> str:
    """``text`` with each of ``secrets`` (in every spelling) replaced by ``[redacted]``."""
    for secret in secrets:
        text = scrub(text, secret)
    return text


def _outcome_of(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    if 300 <= status < 400:
        return "redirect"
    if 400 <= status < 500:
        return "http_4xx"
    if 500 <= status < 600:
        return "http_5xx"
    return "http_other"


def http_request(tool: str, method: str, url: str, *, timeout: float, params=None, headers: dict | None = None,
                 json=None, content=None, data=None, files=None, keep_alive: bool = False,
                 connect_timeout: float = 3.0) -> httpx.Response:
    """Send one request of ``tool`` (a name of :data:`apps.gateway.tools.TOOLS`) to the absolute
    ``url`` (``params``, ``json``, ``content``, ``data``, ``files`` as httpx takes them), within
    ``timeout`` seconds for the whole call (connecting at most ``connect_timeout`` of them), and
    return the answer with its body read. See the module for what happens on the way.

    Raises :class:`DestinationRefused` (nothing left the process), :class:`ConnectFailed` (nothing
    was sent), :class:`CallTimedOut` and :class:`TransportFailed` (it may have been handled),
    :class:`ResponseTooLarge` (handled; the answer was cut). Each is recorded, as is every answer."""
    at, started = timezone.now(), time.monotonic()
    try:
        dest = destination_of(url)
    except ValueError:
        dest = Destination("?", "", 0)
    try:
        path = httpx.URL(url).path if dest.port else ""
    except httpx.InvalidURL:  # a control character in it: refused below, as a URL nothing can be sent to
        dest, path = Destination("?", "", 0), ""

    span = spans.start(tool, method, dest, path)

    def record(outcome: str, status: int | None = None, nbytes: int = 0) -> None:
        call_record(tool=tool, destination=dest, method=method, path=path, outcome=outcome, at=at,
                    duration_ms=int((time.monotonic() - started) * 1000), http_status=status,
                    bytes_received=nbytes)
        spans.end(span, outcome, status)

    try:
        allowed = tools.allowed_destinations(tool)
    except ValueError as exc:  # a listed URL that cannot be read: nothing is reachable until it is fixed
        record("refused_destination")
        raise DestinationRefused(tool, f"its list of destinations cannot be read ({exc})") from None
    if not dest.port or dest not in allowed:
        record("refused_destination")
        raise DestinationRefused(tool, f"{dest} is not a destination {tool} may reach")
    try:
        injected = credentials.authorization(tool)
    except OSError as exc:
        record("bad_credential")
        raise ConnectFailed(tool, f"its credential could not be read ({type(exc).__name__}); nothing sent") from None
    secrets = credentials.secret_parts(injected)
    if any(not _HEADER_VALUE.fullmatch(v) for v in injected.values()):
        record("bad_credential")
        raise ConnectFailed(tool, "its credential cannot be sent in a header (a line break or a character "
                                  "outside ASCII: check the secret's file); nothing sent") from None
    if tool in _NEVER_HANDED_A_CREDENTIAL:
        json, content = _without_credentials(json, content)
    cap = tools.caps(tool).max_bytes
    client = _client(tool, keep_alive)
    try:
        request = client.build_request(
            method, url, params=params, json=json, content=content, data=data, files=files,
            headers={**(headers or {}), **spans.propagation_headers(span), "Accept-Encoding": "identity",
                     **injected},
            timeout=httpx.Timeout(timeout, connect=min(timeout, connect_timeout)))
    except (httpx.InvalidURL, UnicodeError, ValueError, TypeError) as exc:  # a URL or header that cannot be sent
        record("connect_error")
        raise ConnectFailed(tool, f"the request cannot be built ({type(exc).__name__}); nothing sent") from None
    call = _local.call = _Call(deadline=started + timeout, hosts=frozenset({(dest.host, dest.port)}))
    status, nbytes = None, 0
    try:
        response = client.send(request, stream=True)
        status = response.status_code
        try:
            chunks = []
            for chunk in decoded(response.iter_raw(), response.headers.get("content-encoding", ""), cap):
                nbytes += len(chunk)
                if nbytes > cap:
                    raise TooLarge
                chunks.append(chunk)
            body = b"".join(chunks)
        finally:
            response.close()
    except GatewayError as exc:
        record(exc.outcome, status, nbytes)
        raise
    except TooLarge:
        record("too_large", status, nbytes)
        raise ResponseTooLarge(tool, f"the answer is larger than {cap} bytes; not read further",
                               status=status) from None
    except (UnsupportedEncoding, zlib.error) as exc:
        record("transport_error", status, nbytes)
        raise TransportFailed(tool, f"{dest}: the answer could not be decoded: {exc}", status=status) from None
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        if call.refused:
            record("refused_destination")
            raise DestinationRefused(tool, f"the connection to {call.refused[0]} was refused at the socket") from None
        record("connect_error")
        raise ConnectFailed(tool, f"no connection to {dest}: {type(exc).__name__}: {_scrubbed(str(exc), secrets)}") \
            from None
    except httpx.TimeoutException as exc:
        record("timeout", status, nbytes)
        raise CallTimedOut(tool, f"no complete answer from {dest} within {timeout:.1f} s ({type(exc).__name__})",
                           status=status) from None
    except (httpx.HTTPError, httpcore.ConnectionNotAvailable, OSError) as exc:
        record("transport_error", status, nbytes)
        raise TransportFailed(tool, f"{dest}: sent, no answer: {type(exc).__name__}: {_scrubbed(str(exc), secrets)}",
                              status=status) from None
    finally:
        _local.call = None
    record(_outcome_of(status), status, nbytes)
    kept = [(k, v) for k, v in response.headers.multi_items()
            if k.lower() not in _HOP_HEADERS and _scrubbed(k, secrets) == k and _scrubbed(v, secrets) == v]
    answer = httpx.Response(status, headers=kept, content=body, request=request)
    clean, text = None, answer.text
    for secret in secrets:  # an upstream echoing the credential: the caller never sees it
        cleaned = scrub_body(body if clean is None else clean, text, secret)
        if cleaned is not None:
            clean, text = cleaned, cleaned.decode("utf-8", "replace")
    if clean is None:
        return answer
    kept = [(k, v) for k, v in kept if k.lower() != "content-type"]
    kind = answer.headers.get("content-type", "application/octet-stream").split(";")[0].strip()
    return httpx.Response(status, headers=[*kept, ("Content-Type", f"{kind}; charset=utf-8")], content=clean,
                          request=request)
