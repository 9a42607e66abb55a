"""Fixtures of the connector tests: a loopback HTTP server with fixed answers."""

import pytest


@pytest.fixture
def server_answering(settings):
    """A loopback HTTP server answering ``"METHOD /path"`` (query string aside) with a fixed
    ``(status, JSON body)`` (``bytes``: sent as they are); returns its URL, which the tool gateway
    lets both ticket systems' connectors reach (``FAULTDESK_GATEWAY_ALLOW_*``)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.gateway import allow

    servers = []

    def start(answers):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                status, body = answers.get(f"{self.command} {self.path.split('?')[0]}", (404, {"error": "x"}))
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        allow(settings, "ticket.reference", url)
        allow(settings, "ticket.helpdesk", url)
        return url

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()
