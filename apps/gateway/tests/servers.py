"""Real servers on loopback for the gateway tests: an HTTP server that records what it was sent and
answers from a script, and a listener that only counts the connections that reach it."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class CountingListener:
    """A TCP listener on a free loopback port that accepts and closes, counting ``accepts``: proof
    that no connection reached it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepts += 1
            conn.close()

    def close(self):
        self.sock.close()


class Recorder(ThreadingHTTPServer):
    """An HTTP/1.1 server on a free loopback port. Every request's method, path and headers are kept
    in ``seen``; ``answers["METHOD /path"]`` is ``(status, headers, body)`` or a callable taking the
    handler (to trickle, to redirect); anything else answers 200 ``{}``."""

    daemon_threads = True

    def __init__(self, answers=None):
        self.answers = answers or {}
        self.seen: list[dict] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _any(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                                 "body": body, "client_port": self.client_address[1]})
        answer = self.server.answers.get(f"{self.command} {self.path.split('?')[0]}", (200, {}, b"{}"))
        if callable(answer):
            answer(self)
            return
        status, headers, data = answer
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **headers}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = _any

    def log_message(self, *args):
        pass


def trickle(total: int, every: float):
    """An answer that promises ``total`` bytes and sends one every ``every`` seconds."""

    def answer(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(total))
        handler.end_headers()
        try:
            for _ in range(total):
                handler.wfile.write(b"x")
                handler.wfile.flush()
                time.sleep(every)
        except OSError:
            pass

    return answer


def trickled_headers(every: float, count: int = 200):
    """An answer whose header lines come one every ``every`` seconds, without end."""

    def answer(handler):
        try:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for i in range(count):
                handler.wfile.write(b"X-Slow-%d: y\r\n" % i)
                handler.wfile.flush()
                time.sleep(every)
        except OSError:
            pass
        handler.close_connection = True

    return answer
