"""The fault proxy's partition (tools/faultproxy.py): while it is on, no request reaches the upstream
and no answer reaches the client; a request already forwarded loses its answer; once healed,
traffic flows again."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tools.faultproxy import serve_in_thread


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        self.seen: list[str] = []
        super().__init__(("127.0.0.1", 0), _Echo)


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.server.seen.append(self.path)
        if self.path.startswith("/slow"):
            time.sleep(1.0)
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def proxy():
    upstream = _Upstream()
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proxy = serve_in_thread(0, f"http://127.0.0.1:{upstream.server_address[1]}")
    yield proxy, upstream
    proxy.shutdown()
    proxy.server_close()
    upstream.shutdown()
    upstream.server_close()


def test_a_request_during_a_partition_never_reaches_the_upstream_and_gets_no_answer(proxy):
    server, upstream = proxy
    assert httpx.post(f"{server.url}/_proxy/partition", json={"seconds": 1.5}).json()["partitioned"] is True
    started = time.monotonic()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/tickets", timeout=5)
    assert time.monotonic() - started >= 1.2  # held until the partition healed, then closed unanswered
    assert upstream.seen == []
    assert httpx.get(f"{server.url}/tickets", timeout=5).json() == {"ok": True}
    assert upstream.seen == ["/tickets"]
    assert httpx.get(f"{server.url}/_proxy/partition").json() == {"partitioned": False, "seconds_left": 0.0,
                                                                  "swallowed": 1}


def test_a_client_that_gives_up_first_sees_a_timeout(proxy):
    server, upstream = proxy
    httpx.post(f"{server.url}/_proxy/partition", json={"seconds": 3})
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{server.url}/tickets", timeout=0.5)
    httpx.post(f"{server.url}/_proxy/partition", json={"seconds": 0})  # heals at once
    assert httpx.get(f"{server.url}/tickets", timeout=5).status_code == 200


def test_an_answer_that_comes_back_during_a_partition_is_lost(proxy):
    server, upstream = proxy
    result: dict = {}

    def slow():
        try:
            result["status"] = httpx.get(f"{server.url}/slow", timeout=5).status_code
        except httpx.HTTPError as exc:
            result["error"] = exc

    caller = threading.Thread(target=slow)
    caller.start()
    time.sleep(0.3)  # forwarded; the upstream answers after 1 s
    httpx.post(f"{server.url}/_proxy/partition", json={"seconds": 1.5})
    caller.join(10)
    assert upstream.seen == ["/slow"] and "error" in result and "status" not in result


@pytest.mark.parametrize("body", [{"seconds": "soon"}, {"seconds": -1}, {"seconds": 7200}])
def test_a_bad_partition_length_is_refused(proxy, body):
    server, _ = proxy
    resp = httpx.post(f"{server.url}/_proxy/partition", json=body)
    assert resp.status_code == 400 and resp.json()["error"] == "bad_request"
    assert httpx.get(f"{server.url}/_proxy/partition").json()["partitioned"] is False


def test_slow_reads_delay_the_gets_under_their_prefix_and_nothing_else(proxy):
    """``make bench``'s ``reads`` phase: a ticket system that answers its reads slowly. Only the GETs
    under the prefix wait (counted; no time is asserted), writes and other paths go straight through."""
    server, upstream = proxy
    state = httpx.post(f"{server.url}/_proxy/slow-reads", json={"seconds": 0.01, "prefix": "/tickets/"}).json()
    assert state == {"seconds": 0.01, "prefix": "/tickets/", "delayed": 0}
    assert httpx.get(f"{server.url}/tickets/7", timeout=5).json() == {"ok": True}
    httpx.get(f"{server.url}/healthz", timeout=5)
    assert httpx.get(f"{server.url}/_proxy/slow-reads").json()["delayed"] == 1
    httpx.post(f"{server.url}/_proxy/slow-reads", json={"seconds": 0})
    httpx.get(f"{server.url}/tickets/8", timeout=5)
    assert httpx.get(f"{server.url}/_proxy/slow-reads").json() == {"seconds": 0.0, "prefix": "/", "delayed": 1}
    assert upstream.seen == ["/tickets/7", "/healthz", "/tickets/8"]


@pytest.mark.parametrize("body", [{"seconds": "soon"}, {"seconds": 61}, {"seconds": 1, "prefix": "tickets"}])
def test_a_bad_slow_reads_setting_is_refused(proxy, body):
    server, _ = proxy
    resp = httpx.post(f"{server.url}/_proxy/slow-reads", json=body)
    assert resp.status_code == 400 and resp.json()["error"] == "bad_request"
    assert httpx.get(f"{server.url}/_proxy/slow-reads").json()["seconds"] == 0.0
