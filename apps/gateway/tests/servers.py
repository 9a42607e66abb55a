"""Real servers on loopback for the gateway tests: an HTTP server that records what it was sent and
answers from a script, a listener that only counts the connections that reach it, and an SMTP relay."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
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


@contextmanager
def smtp_relay_on_loopback(handler, authenticator=None):
    """An aiosmtpd relay on a free loopback port, handing its messages to ``handler`` (aiosmtpd's
    handler object); with ``authenticator`` it requires ``AUTH`` (over plain text: loopback only).
    Yields the port; stops the relay on the way out."""
    from aiosmtpd.controller import Controller

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth = {"authenticator": authenticator, "auth_required": True, "auth_require_tls": False} if authenticator else {}
    controller = Controller(handler, hostname="127.0.0.1", port=port, **auth)
    controller.start()
    try:
        yield port
    finally:
        controller.stop()


def use_relay(settings, port: int, user: str = "", password: str = "",
              backend: str = "apps.gateway.smtp.GatewayEmailBackend") -> None:
    """Point the e-mail settings at the loopback relay on ``port``, with that login (none when empty)."""
    settings.EMAIL_BACKEND = backend
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER, settings.EMAIL_HOST_PASSWORD, settings.EMAIL_HOST_PASSWORD_FILE = user, password, ""
    settings.EMAIL_TIMEOUT = 5


def slow_name_lookup(monkeypatch, name: str, seconds: float = 3.0) -> None:
    """Make the resolver take ``seconds`` to answer for ``name`` (then as for 127.0.0.1); other names
    resolve as before."""
    real = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host == name:
            time.sleep(seconds)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
