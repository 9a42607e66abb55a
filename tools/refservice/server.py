"""HTTP layer of the reference ticket service: connections, auth, faults and JSON I/O.

The API is documented in the package docstring (:mod:`tools.refservice`); the endpoints
and their routing are in :mod:`.routes`.
"""

import contextlib
import hmac
import json
import logging
import socket
import socketserver
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from . import store as storage
from .faults import FaultInjector
from .routes import MAX_BODY_BYTES, Request, Response, find_route
from .validation import ApiError, invalid
from .webhooks import WebhookSender

log = logging.getLogger(__name__)


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
    # The headers and the body go out as separate writes: without TCP_NODELAY a client that reuses
    # the connection waits out its own delayed ACK (about 40 ms) for the body.
    disable_nagle_algorithm = True
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
        url = urlsplit(self.path)
        route, params = find_route(url.path)
        body = self._read_body(route.max_body if route is not None else MAX_BODY_BYTES)
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

    def _read_body(self, limit=MAX_BODY_BYTES):
        """Read the whole body (always, so keep-alive stays in sync); 411/413/400 on bad framing
        (413 above ``limit`` bytes: the route's own limit)."""
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
        if size > limit:
            self.close_connection = True
            raise ApiError(413, "payload_too_large", detail=f"bodies are limited to {limit} bytes")
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
        self._connections = set()
        super().__init__(server_address, RefServiceHandler)

    def get_request(self):
        """Accept a connection and remember it, so :meth:`shutdown` can close kept-alive ones."""
        sock, address = super().get_request()
        with self._inflight_lock:
            self._connections.add(sock)
        return sock, address

    def shutdown_request(self, request):
        """Forget a connection once its handler is done with it (then close it, as the base does)."""
        with self._inflight_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

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
        # A stopped service answers nothing more: connections its clients kept alive are cut too
        # (their handler threads would otherwise serve them on, past the shutdown).
        with self._inflight_lock:
            open_now = list(self._connections)
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

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
