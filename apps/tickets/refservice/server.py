"""HTTP layer of the reference ticket service: routing, auth, faults and JSON I/O.

The API is documented in the package docstring (:mod:`apps.tickets.refservice`).
Route handlers are plain functions ``handler(server, request) -> Response | None``;
``None`` means "close the connection without answering" (the lost-response fault).
"""

import hmac
import json
import logging
import re
import socketserver
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from . import store as storage
from .faults import FaultInjector
from .validation import (
    ApiError,
    body_digest,
    invalid,
    parse_fencing_token,
    parse_idempotency_key,
    parse_if_match,
    parse_json_object,
    validate_comment,
    validate_create,
    validate_faults,
    validate_patch,
)
from .webhooks import WebhookSender

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024


@dataclass
class Request:
    """A parsed request as route handlers see it.

    ``query`` maps each query parameter to its first value; ``params`` holds the
    named groups of the route pattern (e.g. ``ticket_id``); ``body`` is raw bytes.
    """

    method: str
    path: str
    query: dict
    headers: object
    body: bytes
    params: dict


@dataclass
class Response:
    """A JSON response: HTTP ``status``, ``body`` (serialised to JSON) and extra ``headers``."""

    status: int
    body: object
    headers: dict = field(default_factory=dict)


@contextmanager
def _store_errors():
    """Turn the store's refusals into their HTTP answers (none of them changed anything)."""
    try:
        yield
    except storage.NotFound:
        raise ApiError(404, "not_found") from None
    except storage.VersionMismatch as exc:
        raise ApiError(412, "version_mismatch", headers={"ETag": f'"{exc.current_version}"'},
                       current_version=exc.current_version) from None
    except storage.StaleFencingToken as exc:
        raise ApiError(409, "stale_fencing_token", highest=exc.highest) from None
    except storage.FencingTokenRequired:
        raise ApiError(409, "fencing_token_required",
                       detail="this Idempotency-Key was fenced: send X-Fencing-Token") from None
    except storage.IdempotencyKeyReused:
        raise ApiError(422, "idempotency_key_reused",
                       detail="this Idempotency-Key was already used with a different request body") from None


def _ticket_response(status, ticket, **headers):
    return Response(status, ticket, {"ETag": f'"{ticket["version"]}"', **headers})


# --- route handlers ---------------------------------------------------------------------------


def healthz(server, request):
    """``GET /healthz`` -> 200 ``{"ok": true}`` (no authentication)."""
    return Response(200, {"ok": True})


def create_ticket(server, request):
    """``POST /tickets``: idempotent, fenced ticket creation, with injected faults applied.

    Validates headers and body first (400s use up no fault), then runs as a
    :func:`_keyed_write` (409 while the key is in flight, the next armed fault).
    """
    key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
    server.count_request(key)
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    payload = parse_json_object(request.body)
    fields = validate_create(payload)
    digest = body_digest(payload)

    def create():
        with _store_errors():
            result = server.store.create_ticket(key, digest, fields, fencing_token)
        headers = {"Location": f"/tickets/{result.body['id']}"}
        if result.replayed:
            headers["Idempotent-Replayed"] = "true"
        return _ticket_response(result.status, result.body, **headers)

    return _keyed_write(server, key, "POST /tickets", create)


def _keyed_write(server, key, what, write):
    """Run ``write()`` (which returns the :class:`Response`) for a request carrying idempotency
    ``key``: 409 ``request_in_progress`` while another request with the key is being processed,
    and the next armed fault applied — ``fail_503`` answers 503 without touching storage,
    ``delay`` sleeps first, ``drop_after_commit`` commits and returns None (the connection is
    closed unanswered)."""
    if not server.key_begin(key):
        # Another request with this key is being processed: its outcome is not known yet.
        raise ApiError(409, "request_in_progress", headers={"Retry-After": "1"},
                       detail="a request with this Idempotency-Key is in progress; retry later with the same key")
    try:
        fault = server.faults.take()
        if fault and fault.mode == "fail_503":
            log.warning("fault fail_503: rejecting %s key=%s", what, key)
            return Response(503, {"error": "temporarily_unavailable"}, {"Retry-After": "1"})
        if fault and fault.mode == "delay":
            time.sleep(fault.delay_seconds)
        response = write()
        if fault and fault.mode == "drop_after_commit":
            log.warning("fault drop_after_commit: committed %s key=%s, dropping the response", what, key)
            return None
        return response
    finally:
        server.key_end(key)


def fence_key(server, request):
    """``POST /fences`` with ``Idempotency-Key`` and ``X-Fencing-Token`` (both required): raise the
    key's highest fencing token, whether or not a ticket exists for it, and answer 200
    ``{"idempotency_key", "highest_fencing_token", "ticket": ticket | null}``. A token below the
    stored maximum gets 409 ``stale_fencing_token`` and changes nothing."""
    key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    if fencing_token is None:
        raise invalid("X-Fencing-Token: required for a fence")
    try:
        result = server.store.fence(key, fencing_token)
    except storage.StaleFencingToken as exc:
        raise ApiError(409, "stale_fencing_token", highest=exc.highest) from None
    return Response(200, {"idempotency_key": key, "highest_fencing_token": result.highest_fencing_token,
                          "ticket": result.ticket, "comment": result.comment, "update": result.update})


def add_comment(server, request):
    """``POST /tickets/<id>/comments``: a comment, exactly once per ``Idempotency-Key``.

    Body ``{"body": str}`` (1..20000 characters). ``If-Match`` (optional) makes it conditional
    on the ticket's version (412 ``version_mismatch``); ``X-Fencing-Token`` as for creates.
    201 ``{"comment", "ticket_id", "ticket_version"}`` (with ``Idempotent-Replayed: true`` for a
    replay), 404, 409, 412 or 422 (the key was used with another body or ticket)."""
    key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
    server.count_request(key)
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    if_match = request.headers.get("If-Match")
    expected_version = parse_if_match(if_match) if if_match is not None else None
    payload = parse_json_object(request.body)
    body = validate_comment(payload)

    def comment():
        with _store_errors():
            result = server.store.add_comment(request.params["ticket_id"], key, body_digest(payload), body,
                                              expected_version, fencing_token)
        headers = {"ETag": f'"{result.body["ticket_version"]}"'}
        if result.replayed:
            headers["Idempotent-Replayed"] = "true"
        return Response(201, result.body, headers)

    return _keyed_write(server, key, "POST comment", comment)


def lookup_comments(server, request):
    """``GET /tickets/<id>/comments?idempotency_key=K`` -> 200 ``{"results": [comment response]}``."""
    key = request.query.get("idempotency_key")
    if not key:
        raise invalid("query parameter idempotency_key is required")
    found = server.store.find_comment_by_key(request.params["ticket_id"], key)
    return Response(200, {"results": [found] if found else []})


def lookup_tickets(server, request):
    """``GET /tickets?idempotency_key=K`` -> 200 ``{"results": [ticket]}`` (0 or 1 entries)."""
    key = request.query.get("idempotency_key")
    if not key:
        raise invalid("query parameter idempotency_key is required")
    ticket = server.store.find_by_idempotency_key(key)
    return Response(200, {"results": [ticket] if ticket else []})


def get_ticket(server, request):
    """``GET /tickets/<id>`` -> 200 ticket with ``ETag``, or 404 ``not_found``."""
    ticket = server.store.get_ticket(request.params["ticket_id"])
    if ticket is None:
        raise ApiError(404, "not_found")
    return _ticket_response(200, ticket)


def patch_ticket(server, request):
    """``PATCH /tickets/<id>`` with ``If-Match``: 200 new version, 404, 412 or 428. With an
    ``Idempotency-Key`` (optional) the update happens once per key: the same key again replays
    the stored ticket (``Idempotent-Replayed: true``), the key with another body or ticket gets
    422; ``X-Fencing-Token`` as for creates."""
    expected_version = parse_if_match(request.headers.get("If-Match"))
    raw_key = request.headers.get("Idempotency-Key")
    key = parse_idempotency_key(raw_key) if raw_key is not None else None
    if key is not None:
        server.count_request(key)
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    payload = parse_json_object(request.body)
    changes = validate_patch(payload)

    def update():
        with _store_errors():
            result = server.store.update_ticket(request.params["ticket_id"], expected_version, changes, key,
                                                body_digest(payload), fencing_token)
        if server.webhooks is not None:
            server.webhooks.wake()
        headers = {"Idempotent-Replayed": "true"} if result.replayed else {}
        return _ticket_response(200, result.body, **headers)

    return update() if key is None else _keyed_write(server, key, "PATCH", update)


def lookup_updates(server, request):
    """``GET /tickets/<id>/updates?idempotency_key=K`` -> 200 ``{"results": [ticket as that
    update left it]}`` (0 or 1 entries)."""
    key = request.query.get("idempotency_key")
    if not key:
        raise invalid("query parameter idempotency_key is required")
    found = server.store.find_update_by_key(request.params["ticket_id"], key)
    return Response(200, {"results": [found] if found else []})


def admin_effects(server, request):
    """``GET /_admin/effects?idempotency_key=K`` -> ``{"idempotency_key": K, "effects": N,
    "requests": M}``: tickets really created for K (0 or 1), and ``POST /tickets`` requests with K
    received since the process started (whatever their answer)."""
    key = request.query.get("idempotency_key")
    if not key:
        raise invalid("query parameter idempotency_key is required")
    return Response(200, {"idempotency_key": key, "effects": server.store.effects(key),
                          "requests": server.requests_for(key)})


def admin_tickets(server, request):
    """``GET /_admin/tickets`` -> ``{"results": [every ticket, oldest first]}``."""
    return Response(200, {"results": server.store.list_tickets()})


def admin_webhooks(server, request):
    """``GET /_admin/webhooks`` -> ``{"results": [{"event_id", "body", "attempts", "delivered_at",
    "last_status"}]}``, oldest first."""
    return Response(200, {"results": server.store.list_webhooks()})


def admin_faults(server, request):
    """``POST /_admin/faults`` -> arm a fault; 200 ``{"mode", "remaining", "delay_seconds"}``."""
    mode, count, delay_seconds = validate_faults(parse_json_object(request.body))
    state = server.faults.arm(mode, count, delay_seconds)
    log.info("faults armed: %s", state)
    return Response(200, state)


def admin_reset(server, request):
    """``POST /_admin/reset`` -> wipe tickets, keys and faults; 200 ``{"ok": true}``."""
    server.store.reset()
    server.faults.clear()
    log.info("reset: all tickets, idempotency keys and faults wiped")
    return Response(200, {"ok": True})


@dataclass(frozen=True)
class Route:
    """A path ``pattern`` (full match), its ``methods`` (name -> handler) and whether it is ``public``."""

    pattern: re.Pattern
    methods: dict
    public: bool = False


ROUTES = (
    Route(re.compile(r"/healthz"), {"GET": healthz}, public=True),
    Route(re.compile(r"/tickets"), {"GET": lookup_tickets, "POST": create_ticket}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)"), {"GET": get_ticket, "PATCH": patch_ticket}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)/comments"), {"GET": lookup_comments, "POST": add_comment}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)/updates"), {"GET": lookup_updates}),
    Route(re.compile(r"/fences"), {"POST": fence_key}),
    Route(re.compile(r"/_admin/effects"), {"GET": admin_effects}),
    Route(re.compile(r"/_admin/tickets"), {"GET": admin_tickets}),
    Route(re.compile(r"/_admin/faults"), {"POST": admin_faults}),
    Route(re.compile(r"/_admin/webhooks"), {"GET": admin_webhooks}),
    Route(re.compile(r"/_admin/reset"), {"POST": admin_reset}),
)


def find_route(path):
    """Return ``(route, params)`` for ``path``, or ``(None, {})`` when no route matches."""
    for route in ROUTES:
        match = route.pattern.fullmatch(path)
        if match:
            return route, match.groupdict()
    return None, {}


# --- HTTP plumbing -----------------------------------------------------------------------------

_ERROR_NAMES = {
    400: "bad_request",
    408: "request_timeout",
    414: "uri_too_long",
    431: "headers_too_large",
    501: "not_implemented",
    505: "http_version_not_supported",
}


class RefServiceHandler(BaseHTTPRequestHandler):
    """Per-connection request handler: reads the body, authenticates, routes, answers JSON.

    Expected errors become their JSON error response; anything else is logged
    and answered with 500 ``{"error":"internal"}``.
    """

    server_version = "faultdesk-refservice/1"
    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds an idle keep-alive connection may hold its thread

    def do_GET(self):
        """Dispatch a GET request."""
        self._dispatch()

    do_POST = do_PATCH = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def _dispatch(self):
        try:
            response = self._handle()
        except ApiError as exc:
            response = Response(exc.status, exc.body, exc.headers)
        except Exception:
            log.exception("internal error handling %s %s", self.command, self.path)
            response = Response(500, {"error": "internal"})
        if response is None:
            self.close_connection = True  # lost response: close without writing anything
            return
        self._send(response)

    def _handle(self):
        body = self._read_body()
        url = urlsplit(self.path)
        route, params = find_route(url.path)
        if route is None or not route.public:
            self._authenticate()
        if route is None:
            raise ApiError(404, "not_found")
        handler = route.methods.get(self.command)
        if handler is None:
            allowed = sorted(route.methods)
            raise ApiError(405, "method_not_allowed", headers={"Allow": ", ".join(allowed)}, allowed=allowed)
        query = {name: values[0] for name, values in parse_qs(url.query).items()}
        request = Request(self.command, url.path, query, self.headers, body, params)
        return handler(self.server, request)

    def _read_body(self):
        """Read the whole body (always, so keep-alive stays in sync); 411/413/400 on bad framing."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise ApiError(
                411, "length_required", detail="send a Content-Length; chunked bodies are not supported"
            )
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
            if size < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise invalid("Content-Length: must be a non-negative integer") from None
        if size > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, "payload_too_large", detail=f"bodies are limited to {MAX_BODY_BYTES} bytes")
        return self.rfile.read(size)

    def _authenticate(self):
        api_key = self.server.api_key
        if not api_key:
            return
        supplied = self.headers.get("Authorization", "")
        scheme, _, token = supplied.partition(" ")
        valid = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("utf-8", "surrogateescape"), api_key.encode("utf-8")
        )
        if not valid:
            raise ApiError(401, "unauthorized", headers={"WWW-Authenticate": "Bearer"})

    def _send(self, response):
        payload = json.dumps(response.body, ensure_ascii=False).encode("utf-8")
        self.send_response(response.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in response.headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def send_error(self, code, message=None, explain=None):
        """Answer protocol-level errors (malformed request, unknown method) with JSON, not HTML."""
        self.close_connection = True
        detail = message or HTTPStatus(code).phrase
        self._send(Response(code, {"error": _ERROR_NAMES.get(code, "bad_request"), "detail": detail}))

    def log_message(self, format, *args):
        """Send the access log to the ``logging`` module instead of stderr."""
        log.info("%s %s", self.address_string(), format % args)


class RefServiceServer(ThreadingHTTPServer):
    """Threaded HTTP server holding the service state: ``store``, ``faults``, ``api_key``.

    ``url`` is the base URL. :meth:`shutdown` stops serving, joins the thread
    started by :func:`serve_in_thread` and closes the socket; it is idempotent.
    """

    daemon_threads = True
    request_queue_size = 128  # listen backlog; the stdlib default of 5 resets bursts of clients

    def __init__(self, server_address, store, api_key=None, webhook_url=None, webhook_secret=None):
        self.store = store
        self.webhooks = None
        if webhook_url and webhook_secret:
            store.record_webhooks = True
            self.webhooks = WebhookSender(store, webhook_url, webhook_secret)
        self.faults = FaultInjector()
        self._inflight = set()
        self._requests = {}
        self._inflight_lock = threading.Lock()
        self.api_key = api_key or None
        self.thread = None
        self._serving = False
        super().__init__(server_address, RefServiceHandler)

    def server_bind(self):
        """Bind without the reverse-DNS lookup ``HTTPServer.server_bind`` does."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def count_request(self, key):
        """Count one ``POST /tickets`` with idempotency ``key`` (for tests: requests, not effects)."""
        with self._inflight_lock:
            self._requests[key] = self._requests.get(key, 0) + 1

    def requests_for(self, key):
        """How many ``POST /tickets`` with ``key`` arrived since the process started."""
        with self._inflight_lock:
            return self._requests.get(key, 0)

    def key_begin(self, key):
        """Mark a create with idempotency ``key`` as in progress; False if one already is."""
        with self._inflight_lock:
            if key in self._inflight:
                return False
            self._inflight.add(key)
            return True

    def key_end(self, key):
        """The create with ``key`` finished (answered, refused or dropped)."""
        with self._inflight_lock:
            self._inflight.discard(key)

    @property
    def url(self):
        """Base URL, e.g. ``http://127.0.0.1:8765``."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self, poll_interval=0.5):
        """Serve until :meth:`shutdown` (see ``socketserver.BaseServer.serve_forever``)."""
        self._serving = True
        try:
            super().serve_forever(poll_interval)
        finally:
            self._serving = False

    def shutdown(self):
        """Stop serving (if running), join the serving thread, close the listening socket."""
        if self._serving or (self.thread is not None and self.thread.is_alive()):
            super().shutdown()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.webhooks is not None:
            self.webhooks.stop()
        self.server_close()

    def handle_error(self, request, client_address):
        """Log errors that escape a handler (e.g. the client hung up) instead of printing them."""
        log.warning("connection error with %s", client_address, exc_info=True)


def make_server(host, port, db_path, api_key=None, webhook_url=None, webhook_secret=None):
    """Create (but do not start) the service on ``host:port`` with its SQLite file at ``db_path``.

    ``port`` 0 picks a free port (see ``server.server_address``). With a falsy
    ``api_key`` authentication is off. With ``webhook_url`` and ``webhook_secret``
    every status change is delivered there as a signed webhook (:mod:`.webhooks`).
    Returns a :class:`RefServiceServer`; run it with ``serve_forever()``.
    """
    return RefServiceServer((host, port), storage.TicketStore(db_path), api_key, webhook_url, webhook_secret)


def serve_in_thread(host, port, db_path, api_key=None, webhook_url=None, webhook_secret=None):
    """Like :func:`make_server`, but already serving from a daemon thread (for tests).

    Returns the :class:`RefServiceServer`; call ``shutdown()`` to stop it.
    """
    server = make_server(host, port, db_path, api_key, webhook_url, webhook_secret)
    server.thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="refservice", daemon=True
    )
    server.thread.start()
    return server
