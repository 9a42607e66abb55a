"""A no-op ticket service for the outbox benchmark: it speaks just enough of the reference ticket
service's API (``POST /tickets``, ``GET /tickets?idempotency_key=``, ``GET /healthz``) to answer at
once, storing nothing — so the dispatcher's own cost is what is measured.

``python -m tools.bench.noop_remote --port P``. Each ``POST /tickets`` answers 201 with a new
ticket id; a lookup finds nothing."""

from __future__ import annotations

import argparse
import itertools
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ids = itertools.count(1)


class NoopHandler(BaseHTTPRequestHandler):
    """Answers the reference service's create and lookup calls without doing anything."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as the reference service: a reused connection waits for nothing

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's naming
        if self.path.startswith("/healthz"):
            self._answer(200, {"ok": True})
        elif self.path.startswith("/tickets"):
            self._answer(200, {"results": []})
        else:
            self._answer(404, {"detail": "not found"})

    def do_POST(self):  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path.rstrip("/") != "/tickets":
            self._answer(404, {"detail": "not found"})
            return
        n = next(_ids)
        self._answer(201, {"id": f"NOOP-{n:06d}", "version": 1, "status": "open",
                           "idempotency_key": self.headers.get("Idempotency-Key")})

    def log_message(self, *args):  # quiet
        pass


class NoopServer(ThreadingHTTPServer):
    """The server of the no-op remote: a backlog of 128 waiting connections, as the reference service has. With the
    stdlib's 5, a burst of the dispatchers' connections (2 processes × 8 sender threads) overflows
    it, a dropped SYN is retried after 1 s, and that batch waits a second for nothing."""

    daemon_threads = True
    request_queue_size = 128


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.noop_remote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    NoopServer(("127.0.0.1", args.port), NoopHandler).serve_forever()


if __name__ == "__main__":
    main()
