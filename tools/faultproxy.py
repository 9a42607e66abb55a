"""A fault-injecting HTTP reverse proxy, for putting the reference service's faults in front of a
ticket system that has none (django-helpdesk: the recovery table's "response lost after the remote
committed" row against django-helpdesk, and ``make chaos``).

Every request is forwarded unchanged to ``upstream``. Faults armed through
``POST /_proxy/faults`` (same body as the reference service's ``/_admin/faults``: ``mode``
``none|drop_after_commit|fail_503|delay``, ``count``, ``delay_seconds``) apply to the next
``count`` write requests (``POST``/``PATCH``) whose path starts with ``fault_prefix``:

* ``drop_after_commit``: forward, let the upstream commit and answer, then close the client's
  connection without a response (a lost response);
* ``fail_503``: answer 503 without forwarding (nothing happened);
* ``delay``: sleep, then forward.

``POST /_proxy/slow-reads`` with ``{"seconds": S, "prefix": "/tickets/"}`` makes every ``GET`` whose
path starts with ``prefix`` (default ``/``) wait ``S`` seconds before it is forwarded, until changed
(``0`` stops it): a ticket system that answers its reads slowly (``make bench``'s ``reads`` phase). The
armed faults above apply to writes only. ``GET /_proxy/slow-reads`` tells the setting and how many
reads it delayed.

``POST /_proxy/partition`` with ``{"seconds": S}`` cuts the network between the clients and the
upstream for ``S`` seconds (``0`` heals it at once), as a partition that drops packets both ways
would: a request that arrives during it is never forwarded and gets no answer (its connection is
held until the partition heals, then closed); a request forwarded before it began whose answer comes
back during it loses that answer (the upstream may have committed). Reads and writes alike, every
path. ``GET /_proxy/partition`` tells whether one is on and how many requests it swallowed.

Run: ``python -m tools.faultproxy --port P --upstream http://127.0.0.1:8766``.
Standard library only; one thread per connection.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tools.refservice.faults import FaultInjector
from tools.refservice.validation import ApiError, parse_json_object, validate_faults

log = logging.getLogger(__name__)

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "content-length", "host"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as the service behind it: a reused connection waits for nothing

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self._handle()

    do_POST = do_PATCH = do_PUT = do_DELETE = do_GET  # noqa: N815

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/_proxy/faults" and self.command == "POST":
            try:
                mode, count, delay = validate_faults(parse_json_object(body))
            except ApiError as exc:
                return self._answer(exc.status, exc.body)
            return self._answer(200, self.server.faults.arm(mode, count, delay))
        if self.path == "/_proxy/partition":
            if self.command == "POST":
                try:
                    seconds = float(parse_json_object(body).get("seconds", 0))
                except (ApiError, TypeError, ValueError):
                    return self._answer(400, {"error": "bad_request", "detail": "seconds: a number"})
                if not 0 <= seconds <= 3600:
                    return self._answer(400, {"error": "bad_request", "detail": "seconds: 0 to 3600"})
                self.server.partition_for(seconds)
            return self._answer(200, self.server.partition_state())
        if self.path == "/_proxy/slow-reads":
            if self.command == "POST":
                try:
                    seconds, prefix = _slow_reads_body(parse_json_object(body))
                except ApiError as exc:
                    return self._answer(exc.status, exc.body)
                self.server.slow_reads_set(seconds, prefix)
            return self._answer(200, self.server.slow_reads_state())
        if self.server.partitioned():
            return self._swallow()
        if self.command == "GET" and (slow := self.server.slow_read_delay(self.path)):
            time.sleep(slow)
        fault = None
        if self.command in ("POST", "PATCH") and self.path.startswith(self.server.fault_prefix):
            fault = self.server.faults.take()
        if fault and fault.mode == "fail_503":
            return self._answer(503, {"error": "temporarily_unavailable", "injected": True})
        if fault and fault.mode == "delay":
            time.sleep(fault.delay_seconds)
        try:
            status, headers, payload = self._forward(body)
        except OSError as exc:
            return self._answer(502, {"error": "bad_gateway", "detail": repr(exc)})
        if self.server.partitioned():
            return self._swallow()
        if fault and fault.mode == "drop_after_commit":
            log.warning("fault drop_after_commit: %s %s answered %s upstream; dropping it", self.command,
                        self.path, status)
            self.close_connection = True
            return None
        self.send_response(status)
        for name, value in headers:
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        return None

    def _swallow(self):
        """What a partition does to a request: no answer until it heals, then a closed connection."""
        self.server.count_swallowed()
        log.warning("partition: %s %s swallowed", self.command, self.path)
        self.server.wait_healed()
        self.close_connection = True

    def _forward(self, body: bytes):
        up = self.server.upstream
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=self.server.upstream_timeout)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            headers["Host"] = up.netloc
            if body:
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _answer(self, status: int, body: dict):
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        log.info("%s %s", self.address_string(), format % args)


def _slow_reads_body(payload: dict) -> tuple[float, str]:
    """``(seconds, prefix)`` of a ``POST /_proxy/slow-reads`` body; 400 ``bad_request`` otherwise."""
    seconds, prefix = payload.get("seconds", 0), payload.get("prefix", "/")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 60:
        raise ApiError(400, "bad_request", detail="seconds: a number from 0 to 60")
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise ApiError(400, "bad_request", detail="prefix: a path starting with /")
    return float(seconds), prefix


class FaultProxy(ThreadingHTTPServer):
    """The proxy server: ``upstream`` base URL, ``fault_prefix`` of the paths faults apply to."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address, upstream: str, *, fault_prefix: str = "/", upstream_timeout: float = 60.0):
        self.upstream = urlsplit(upstream)
        self.fault_prefix = fault_prefix
        self.upstream_timeout = upstream_timeout
        self.faults = FaultInjector()
        self._partition_lock = threading.Lock()
        self._healed = threading.Event()
        self._healed.set()
        self._partition_until = 0.0
        self._swallowed = 0
        self._slow_reads = (0.0, "/")
        self._slowed = 0
        super().__init__(address, _Handler)

    def slow_reads_set(self, seconds: float, prefix: str = "/") -> None:
        """Delay every later ``GET`` under ``prefix`` by ``seconds`` (0: no more)."""
        with self._partition_lock:
            self._slow_reads = (seconds, prefix)

    def slow_read_delay(self, path: str) -> float:
        """How long the ``GET`` of ``path`` waits before it is forwarded (0.0: not at all); counted."""
        with self._partition_lock:
            seconds, prefix = self._slow_reads
            if seconds <= 0 or not path.startswith(prefix):
                return 0.0
            self._slowed += 1
            return seconds

    def slow_reads_state(self) -> dict:
        """``{"seconds", "prefix", "delayed"}``: the setting and the reads delayed so far."""
        with self._partition_lock:
            seconds, prefix = self._slow_reads
            return {"seconds": seconds, "prefix": prefix, "delayed": self._slowed}

    def partition_for(self, seconds: float) -> None:
        """Cut the network for ``seconds`` from now (0: heal now); a later call replaces the end."""
        with self._partition_lock:
            self._partition_until = time.monotonic() + seconds
            if seconds > 0:
                self._healed.clear()
                threading.Timer(seconds, self._heal_if_due).start()
            else:
                self._healed.set()

    def _heal_if_due(self) -> None:
        with self._partition_lock:
            if time.monotonic() >= self._partition_until - 0.01:
                self._healed.set()

    def partitioned(self) -> bool:
        """True while a partition is on."""
        return not self._healed.is_set()

    def wait_healed(self) -> None:
        """Block until the partition heals."""
        self._healed.wait()

    def count_swallowed(self) -> None:
        with self._partition_lock:
            self._swallowed += 1

    def partition_state(self) -> dict:
        """``{"partitioned": bool, "seconds_left": float, "swallowed": int}``."""
        with self._partition_lock:
            left = max(0.0, self._partition_until - time.monotonic()) if self.partitioned() else 0.0
            return {"partitioned": self.partitioned(), "seconds_left": round(left, 3), "swallowed": self._swallowed}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def serve_in_thread(port: int, upstream: str, **kwargs) -> FaultProxy:
    """Start a proxy on 127.0.0.1:``port`` (0 = any free port) in a daemon thread; ``shutdown()``
    then ``server_close()`` stop it."""
    proxy = FaultProxy(("127.0.0.1", port), upstream, **kwargs)
    threading.Thread(target=proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return proxy


def main(argv=None) -> int:
    """Run the proxy in the foreground until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m tools.faultproxy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:8766")
    parser.add_argument("--fault-prefix", default="/", help="faults apply to writes under this path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = FaultProxy(("127.0.0.1", args.port), args.upstream, fault_prefix=args.fault_prefix)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        proxy.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
