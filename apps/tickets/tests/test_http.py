"""The ticket systems' HTTP transport (:mod:`apps.tickets.http`) against real servers on loopback:
kept-alive connections are reused and never after the peer closed them, and every failure is
exactly one of "not sent" (the remote cannot have acted) and "no answer" (it may have)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from apps.tickets.http import MAX_RESPONSE_BYTES, NoAnswer, NotSent, Pool


class Server:
    """A raw HTTP/1.1 server on loopback: each connection is served by ``behaviour(conn, request)``
    (called per request with the head and body read), and the server counts connections and
    remembers every request."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                with self.lock:
                    self.requests.append((head, body))
                if self.behaviour(conn, head, body) == "close":
                    return
        except OSError:
            return
        finally:
            conn.close()

    def stop(self):
        self.sock.close()


def ok(conn, head, body, *, extra=b""):
    payload = json.dumps({"echo": body.decode() or None, "line": head.split(b"\r\n")[0].decode()}).encode()
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
                 % (len(payload), extra, payload))


@pytest.fixture
def server():
    servers = []

    def start(behaviour=ok):
        s = Server(behaviour)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def test_kept_alive_requests_share_one_connection_and_carry_params_json_and_headers(server):
    s = server()
    pool = Pool(s.url + "/api/", {"Authorization": "Bearer k"}, keep_alive=True)
    for n in range(5):
        resp = pool.request("POST", "/tickets", params={"q": "打印机 x&y"}, json={"n": n, "title": "卡纸"},
                            headers={"Idempotency-Key": f"k{n}"}, timeout=5)
        assert resp.status_code == 200
        assert resp.json()["echo"] == json.dumps({"n": n, "title": "卡纸"}, ensure_ascii=False, separators=(",", ":"))
    assert s.connections == 1
    head, _ = s.requests[-1]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /api/tickets?q=%E6%89%93%E5%8D%B0%E6%9C%BA+x%26y HTTP/1.1"
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers["authorization"] == "Bearer k" and headers["idempotency-key"] == "k4"
    assert headers["content-type"] == "application/json" and "connection" not in headers


def test_without_keep_alive_each_request_has_its_own_connection_and_asks_to_close(server):
    s = server()
    pool = Pool(s.url, keep_alive=False)
    for _ in range(3):
        assert pool.request("GET", "/healthz", timeout=5).status_code == 200
    assert s.connections == 3
    assert all(b"\r\nConnection: close" in head for head, _ in s.requests)


def test_a_connection_the_peer_closed_while_idle_is_not_reused(server):
    def answer_then_close(conn, head, body):
        ok(conn, head, body)  # says nothing about closing, then closes
        return "close"

    s = server(answer_then_close)
    pool = Pool(s.url, keep_alive=True)
    for _ in range(3):
        assert pool.request("GET", "/x", timeout=5).status_code == 200
        time.sleep(0.05)  # the peer's FIN arrives while the connection is idle
    assert s.connections == 3 and len(s.requests) == 3


def test_a_response_that_says_close_is_not_reused(server):
    s = server(lambda conn, head, body: ok(conn, head, body, extra=b"Connection: close\r\n") or "close")
    pool = Pool(s.url, keep_alive=True)
    for _ in range(2):
        assert pool.request("GET", "/x", timeout=5).status_code == 200
    assert s.connections == 2


def test_idle_connections_expire(server):
    s = server()
    pool = Pool(s.url, keep_alive=True, idle_seconds=0.05)
    pool.request("GET", "/x", timeout=5)
    time.sleep(0.1)
    pool.request("GET", "/x", timeout=5)
    assert s.connections == 2


def test_a_refused_connection_is_not_sent():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    with pytest.raises(NotSent, match="connecting to 127.0.0.1"):
        Pool(f"http://127.0.0.1:{port}").request("POST", "/tickets", json={}, timeout=1)


def test_an_unresolvable_host_is_not_sent():
    with pytest.raises(NotSent):
        Pool("http://no-such-host.invalid").request("GET", "/", timeout=1)


def test_a_peer_that_never_answers_is_no_answer_after_the_timeout(server):
    s = server(lambda conn, head, body: time.sleep(3))
    started = time.monotonic()
    with pytest.raises(NoAnswer, match="timed out"):
        Pool(s.url).request("POST", "/tickets", json={"a": 1}, timeout=0.3)
    assert time.monotonic() - started < 2.5
    assert len(s.requests) == 1  # it was sent: the remote may have acted


def test_a_connection_dropped_mid_response_is_no_answer(server):
    def half(conn, head, body):
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{\"id\":")
        return "close"

    s = server(half)
    with pytest.raises(NoAnswer):
        Pool(s.url).request("POST", "/tickets", json={}, timeout=2)
    assert len(s.requests) == 1


def test_a_malformed_status_line_is_no_answer(server):
    s = server(lambda conn, head, body: conn.sendall(b"garbage\r\n\r\n") or "close")
    with pytest.raises(NoAnswer):
        Pool(s.url).request("GET", "/x", timeout=2)


def test_an_oversized_response_is_no_answer(server, monkeypatch):
    monkeypatch.setattr("apps.tickets.http.MAX_RESPONSE_BYTES", 1000)

    def big(conn, head, body):
        payload = b"x" * 5000
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))

    s = server(big)
    with pytest.raises(NoAnswer, match="larger than 1000 bytes"):
        Pool(s.url).request("GET", "/x", timeout=2)
    assert MAX_RESPONSE_BYTES >= 1024 * 1024


def test_concurrent_requests_each_get_a_whole_answer(server):
    s = server()
    pool = Pool(s.url, keep_alive=True)

    def one(n):
        return pool.request("POST", "/tickets", json={"n": n}, timeout=5).json()["echo"]

    with ThreadPoolExecutor(max_workers=8) as workers:
        echoes = list(workers.map(one, range(200)))
    assert echoes == [json.dumps({"n": n}, separators=(",", ":")) for n in range(200)]
    assert s.connections <= 8


def test_only_http_urls_make_a_pool():
    for url in ("ftp://example.org", "127.0.0.1:80", "http://"):
        with pytest.raises(ValueError, match="not an http"):
            Pool(url)


def test_a_chunked_response_is_read_whole_and_a_truncated_one_is_no_answer(server):
    def chunked(conn, head, body):
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n")

    assert Pool(server(chunked).url).request("GET", "/x", timeout=2).json() == {"a": 1}

    def truncated(conn, head, body):
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
        return "close"

    with pytest.raises(NoAnswer):
        Pool(server(truncated).url).request("GET", "/x", timeout=2)


def test_an_oversized_chunked_response_is_no_answer(server, monkeypatch):
    monkeypatch.setattr("apps.tickets.http.MAX_RESPONSE_BYTES", 1000)

    def big(conn, head, body):
        chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk + b"0\r\n\r\n")

    with pytest.raises(NoAnswer, match="larger than 1000 bytes"):
        Pool(server(big).url).request("GET", "/x", timeout=2)


def test_interim_answers_are_read_past_and_never_given_to_the_next_request(server):
    def interim_first(conn, head, body):
        key = [line for line in head.split(b"\r\n") if line.lower().startswith(b"idempotency-key")][0]
        conn.sendall(b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
        time.sleep(0.15)  # the final answer comes later, as a slow API's does
        payload = json.dumps({"key": key.split(b":", 1)[1].strip().decode()}).encode()
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))

    s = server(interim_first)
    pool = Pool(s.url, keep_alive=True)
    first = pool.request("POST", "/tickets", json={}, headers={"Idempotency-Key": "key-A"}, timeout=5)
    second = pool.request("POST", "/tickets", json={}, headers={"Idempotency-Key": "key-B"}, timeout=5)
    assert (first.status_code, first.json()) == (201, {"key": "key-A"})
    assert (second.status_code, second.json()) == (201, {"key": "key-B"})


def test_endless_interim_answers_or_a_protocol_switch_are_no_answer(server):
    s = server(lambda conn, head, body: conn.sendall(b"HTTP/1.1 102 Processing\r\n\r\n" * 40) or "close")
    with pytest.raises(NoAnswer, match="interim"):
        Pool(s.url).request("GET", "/x", timeout=2)
    s = server(lambda conn, head, body: conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\n\r\n") or "close")
    pool = Pool(s.url, keep_alive=True)
    with pytest.raises(NoAnswer, match="interim status 101"):
        pool.request("GET", "/x", timeout=2)
    assert pool._idle == []
