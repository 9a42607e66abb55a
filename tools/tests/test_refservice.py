"""Tests for the reference ticket service (tools.refservice), over real HTTP.

Stdlib only: each call opens a fresh ``http.client`` connection to a server
running in a thread on port 0 with a temporary SQLite file.
"""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tools.refservice import serve_in_thread
from tools.refservice.validation import body_digest

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
REPO_ROOT = Path(__file__).resolve().parents[2]

TICKET = {
    "title": "Router R-12 drops uplink every hour",
    "description": "Uplink flaps; logs attached.",
    "priority": "P2",
    "device": "router-r12",
    "requester": "ana@example.com",
    "tenant": "acme",
    "labels": ["network"],
    "evidence": ["kb/public/uplink-flap.md"],
}


def call(server, method, path, body=None, headers=None, auth=True, raw=None):
    """Send one request on a new connection; return ``(status, headers, json_body)``."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        all_headers = {**(AUTH if auth else {}), **(headers or {})}
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            all_headers.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=all_headers)
        response = conn.getresponse()
        payload = response.read()
        return response.status, response.headers, json.loads(payload) if payload else None
    finally:
        conn.close()


def create(server, key, body=TICKET, **headers):
    """POST /tickets with ``Idempotency-Key: key`` (plus extra headers given as keyword args)."""
    extra = {name.replace("_", "-"): value for name, value in headers.items()}
    return call(server, "POST", "/tickets", body, {"Idempotency-Key": key, **extra})


def effects(server, key):
    """Return the service's effects counter for ``key``."""
    status, _, body = call(server, "GET", f"/_admin/effects?idempotency_key={key}")
    assert status == 200
    return body["effects"]


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "refservice" / "tickets.sqlite3"


@pytest.fixture
def server(db_path):
    srv = serve_in_thread("127.0.0.1", 0, db_path, api_key=API_KEY)
    yield srv
    srv.shutdown()


def test_create_then_get_with_etag(server):
    status, headers, ticket = create(server, "key-1")
    assert status == 201
    assert ticket["id"] == "REF-000001"
    assert ticket["version"] == 1 and ticket["status"] == "open"
    assert ticket["idempotency_key"] == "key-1"
    assert {k: ticket[k] for k in TICKET} == TICKET
    assert ticket["created_at"].endswith("Z")
    assert headers["ETag"] == '"1"'
    assert headers["Location"] == "/tickets/REF-000001"
    assert headers.get("Idempotent-Replayed") is None

    status, headers, fetched = call(server, "GET", "/tickets/REF-000001")
    assert status == 200
    assert fetched == ticket
    assert headers["ETag"] == '"1"'

    status, _, second = create(server, "key-2", {**TICKET, "title": "Another"})
    assert status == 201 and second["id"] == "REF-000002"


def test_defaults_for_optional_fields(server):
    body = {"title": "t", "priority": "P4", "device": "d", "tenant": "t"}
    status, _, ticket = create(server, "minimal", body)
    assert status == 201
    assert ticket["description"] == "" and ticket["requester"] == ""
    assert ticket["labels"] == [] and ticket["evidence"] == [] and ticket["comments"] == []
    assert ticket["assignee"] is None


def test_get_unknown_ticket_is_404(server):
    assert call(server, "GET", "/tickets/REF-999999")[::2] == (404, {"error": "not_found"})


def test_same_key_same_body_replays_stored_response(server):
    status, _, first = create(server, "replay")
    # Same content, different key order and spacing: same canonical digest.
    raw = json.dumps(dict(reversed(list(TICKET.items()))), indent=2).encode()
    status2, headers2, second = call(
        server, "POST", "/tickets", headers={"Idempotency-Key": "replay"}, raw=raw
    )
    assert (status, status2) == (201, 201)
    assert second == first
    assert headers2["Idempotent-Replayed"] == "true"
    assert headers2["ETag"] == '"1"' and headers2["Location"] == f"/tickets/{first['id']}"
    assert effects(server, "replay") == 1
    assert len(call(server, "GET", "/_admin/tickets")[2]["results"]) == 1


def test_same_key_different_body_is_422(server):
    create(server, "reuse")
    status, _, body = create(server, "reuse", {**TICKET, "priority": "P1"})
    assert status == 422
    assert body["error"] == "idempotency_key_reused" and body["detail"]
    assert effects(server, "reuse") == 1


def test_missing_idempotency_key_is_400(server):
    status, _, body = call(server, "POST", "/tickets", TICKET)
    assert (status, body) == (400, {"error": "idempotency_key_required"})


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"",
        b"[]",
        json.dumps({**TICKET, "title": ""}).encode(),
        json.dumps({**TICKET, "title": "x" * 201}).encode(),
        json.dumps({**TICKET, "priority": "P5"}).encode(),
        json.dumps({k: v for k, v in TICKET.items() if k != "tenant"}).encode(),
        json.dumps({**TICKET, "labels": "network"}).encode(),
        json.dumps({**TICKET, "unexpected": 1}).encode(),
    ],
)
def test_invalid_body_is_400(server, raw):
    status, _, body = call(server, "POST", "/tickets", headers={"Idempotency-Key": "bad"}, raw=raw)
    assert status == 400
    assert body["error"] == "invalid_params" and body["detail"]
    assert effects(server, "bad") == 0


def test_auth_required_when_key_configured(server):
    status, headers, body = call(server, "GET", "/tickets/REF-000001", auth=False)
    assert (status, body) == (401, {"error": "unauthorized"})
    assert headers["WWW-Authenticate"] == "Bearer"
    wrong = {"Authorization": "Bearer nope", "Idempotency-Key": "k"}
    assert call(server, "POST", "/tickets", TICKET, wrong, auth=False)[0] == 401
    assert effects(server, "k") == 0
    assert call(server, "GET", "/healthz", auth=False)[::2] == (200, {"ok": True})


def test_auth_off_without_api_key(db_path):
    srv = serve_in_thread("127.0.0.1", 0, db_path)
    try:
        assert create(srv, "no-auth")[0] == 201
        assert call(srv, "GET", "/_admin/tickets", auth=False)[0] == 200
    finally:
        srv.shutdown()


def test_lookup_by_idempotency_key(server):
    _, _, ticket = create(server, "lookup-me")
    status, _, body = call(server, "GET", "/tickets?idempotency_key=lookup-me")
    assert (status, body) == (200, {"results": [ticket]})
    assert call(server, "GET", "/tickets?idempotency_key=unknown")[::2] == (200, {"results": []})
    assert call(server, "GET", "/tickets")[0] == 400


def test_patch_with_if_match(server):
    _, _, ticket = create(server, "patch")
    path = f"/tickets/{ticket['id']}"
    change = {"status": "in_progress", "assignee": "tier2", "comment": "Looking into it"}
    status, headers, patched = call(server, "PATCH", path, change, {"If-Match": '"1"'})
    assert status == 200
    assert patched["version"] == 2 and headers["ETag"] == '"2"'
    assert patched["status"] == "in_progress" and patched["assignee"] == "tier2"
    assert [c["body"] for c in patched["comments"]] == ["Looking into it"]
    assert call(server, "GET", path)[2] == patched

    # A second writer still holding version 1 loses.
    status, headers, body = call(server, "PATCH", path, {"status": "closed"}, {"If-Match": '"1"'})
    assert (status, body) == (412, {"error": "version_mismatch", "current_version": 2})
    assert headers["ETag"] == '"2"'

    status, _, body = call(server, "PATCH", path, {"status": "closed"})
    assert status == 428 and body["error"] == "precondition_required"

    status, _, body = call(server, "PATCH", path, {"status": "bogus"}, {"If-Match": '"2"'})
    assert status == 400 and body["error"] == "invalid_params"
    assert call(server, "PATCH", "/tickets/REF-424242", {"status": "closed"}, {"If-Match": '"1"'})[0] == 404

    status, _, body = call(
        server, "PATCH", path, {"comment": "Fixed", "status": "resolved"}, {"If-Match": '"2"'}
    )
    assert status == 200 and body["version"] == 3 and len(body["comments"]) == 2
    # The idempotent replay still returns the stored create response.
    assert create(server, "patch")[2]["version"] == 1


def test_stale_fencing_token_is_409(server):
    assert create(server, "fenced", X_Fencing_Token="5")[0] == 201
    status, _, body = create(server, "fenced", X_Fencing_Token="4")
    assert (status, body) == (409, {"error": "stale_fencing_token", "highest": 5})
    # Equal is accepted (replay); higher raises the stored maximum.
    assert create(server, "fenced", X_Fencing_Token="5")[0] == 201
    assert create(server, "fenced", X_Fencing_Token="7")[0] == 201
    status, _, body = create(server, "fenced", X_Fencing_Token="6")
    assert (status, body) == (409, {"error": "stale_fencing_token", "highest": 7})
    # A stale token is rejected before the body is compared, and changes nothing.
    assert create(server, "fenced", {**TICKET, "title": "changed"}, X_Fencing_Token="1")[0] == 409
    assert effects(server, "fenced") == 1
    assert create(server, "other", X_Fencing_Token="-1")[0] == 400


def fence(server, key, token):
    """POST /fences for ``key`` at ``token``; return ``(status, json_body)``."""
    status, _, body = call(server, "POST", "/fences", None, {"Idempotency-Key": key, "X-Fencing-Token": str(token)})
    return status, body


def test_fence_without_a_ticket_refuses_lower_tokens_later(server):
    # Nothing was created for the key: the fence answers "no ticket" and raises the maximum.
    assert fence(server, "never-sent", 4) == (200, {"idempotency_key": "never-sent", "highest_fencing_token": 4,
                                                    "ticket": None, "comment": None, "update": None})
    # The stalled request with an older token arrives afterwards: refused, nothing created.
    status, _, body = create(server, "never-sent", X_Fencing_Token="3")
    assert (status, body) == (409, {"error": "stale_fencing_token", "highest": 4})
    assert effects(server, "never-sent") == 0
    # Fencing again at the same token is harmless; a lower fence is itself stale.
    assert fence(server, "never-sent", 4)[0] == 200
    assert fence(server, "never-sent", 2) == (409, {"error": "stale_fencing_token", "highest": 4})
    # The current holder (equal or higher token) may still create.
    assert create(server, "never-sent", X_Fencing_Token="4")[0] == 201
    assert effects(server, "never-sent") == 1


def test_fence_after_a_create_returns_the_ticket(server):
    _, _, ticket = create(server, "sent-once", X_Fencing_Token="1")
    status, body = fence(server, "sent-once", 2)
    assert status == 200 and body["ticket"] == ticket and body["highest_fencing_token"] == 2
    assert create(server, "sent-once", X_Fencing_Token="1")[0] == 409
    assert effects(server, "sent-once") == 1


def test_fence_needs_both_headers(server):
    status, _, body = call(server, "POST", "/fences", None, {"Idempotency-Key": "k"})
    assert status == 400 and body["error"] == "invalid_params"
    status, _, body = call(server, "POST", "/fences", None, {"X-Fencing-Token": "1"})
    assert (status, body) == (400, {"error": "idempotency_key_required"})
    assert call(server, "POST", "/fences", None, {"Idempotency-Key": "k", "X-Fencing-Token": "1"}, auth=False)[0] \
        == 401


def test_fence_races_lower_token_creates(server):
    """Many lower-token creates race one fence: either the ticket existed before the fence (and
    the fence returns it) or none is ever created."""
    for round_no in range(10):
        key = f"race-{round_no}"
        results = []

        def send(k=key, results=results):
            results.append(create(server, k, X_Fencing_Token="1")[0])

        threads = [threading.Thread(target=send) for _ in range(4)]
        for t in threads:
            t.start()
        status, body = fence(server, key, 2)
        for t in threads:
            t.join()
        assert status == 200
        created = effects(server, key)
        if body["ticket"] is None:
            assert created == 0 and set(results) == {409}
        else:
            assert created == 1 and 201 in results


def test_schema_1_fencing_tokens_carry_over(db_path):
    import sqlite3

    srv = serve_in_thread("127.0.0.1", 0, db_path, api_key=API_KEY)
    try:
        assert create(srv, "old", X_Fencing_Token="5")[0] == 201
    finally:
        srv.shutdown()
    # Simulate a schema-1 file: the fences table did not exist.
    with sqlite3.connect(db_path) as conn:
        conn.execute("DROP TABLE fences")
    srv = serve_in_thread("127.0.0.1", 0, db_path, api_key=API_KEY)
    try:
        assert create(srv, "old", X_Fencing_Token="4")[0] == 409
        assert fence(srv, "old", 3)[1]["highest"] == 5
    finally:
        srv.shutdown()


def test_drop_after_commit_then_reconcile(server):
    status, _, body = call(server, "POST", "/_admin/faults", {"mode": "drop_after_commit"})
    assert status == 200 and body["mode"] == "drop_after_commit" and body["remaining"] == 1

    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        create(server, "lost-response")

    # The ticket was committed: reconciliation by key finds it.
    _, _, found = call(server, "GET", "/tickets?idempotency_key=lost-response")
    assert len(found["results"]) == 1
    assert effects(server, "lost-response") == 1

    # A retry with the same key gets the stored ticket, not a second one.
    status, headers, retried = create(server, "lost-response")
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    assert retried == found["results"][0]
    assert effects(server, "lost-response") == 1


def test_fail_503_has_no_effect(server):
    call(server, "POST", "/_admin/faults", {"mode": "fail_503", "count": 2})
    for _ in range(2):
        status, headers, body = create(server, "unavailable")
        assert (status, body) == (503, {"error": "temporarily_unavailable"})
        assert headers["Retry-After"] == "1"
    assert effects(server, "unavailable") == 0
    assert call(server, "GET", "/tickets?idempotency_key=unavailable")[2] == {"results": []}
    # Fault used up: the next attempt creates the ticket.
    status, headers, _ = create(server, "unavailable")
    assert status == 201 and headers.get("Idempotent-Replayed") is None
    assert effects(server, "unavailable") == 1


def test_delay_fault(server):
    call(server, "POST", "/_admin/faults", {"mode": "delay", "delay_seconds": 0.3})
    started = time.monotonic()
    assert create(server, "slow")[0] == 201
    assert time.monotonic() - started >= 0.3


def test_invalid_fault_and_reset(server):
    assert call(server, "POST", "/_admin/faults", {"mode": "explode"})[0] == 400
    create(server, "before-reset")
    call(server, "POST", "/_admin/faults", {"mode": "fail_503", "count": 5})
    assert call(server, "POST", "/_admin/reset")[::2] == (200, {"ok": True})
    assert call(server, "GET", "/_admin/tickets")[2] == {"results": []}
    assert effects(server, "before-reset") == 0
    status, _, ticket = create(server, "after-reset")  # faults were wiped too
    assert status == 201 and ticket["id"] == "REF-000001"


def test_concurrent_same_key_creates_exactly_one_ticket(server):
    barrier = threading.Barrier(20)
    results, errors = [], []

    def worker():
        try:
            barrier.wait()
            results.append(create(server, "race"))
        except Exception as exc:  # collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert errors == []
    assert len(results) == 20
    # Each is either the one creation, a replay of it, or refused while it was in progress.
    created = [r for r in results if r[0] == 201]
    refused = [r for r in results if r[0] == 409]
    assert len(created) + len(refused) == 20
    assert all(body["error"] == "request_in_progress" for _, _, body in refused)
    assert len({body["id"] for _, _, body in created}) == 1
    fresh = [h for _, h, _ in created if h.get("Idempotent-Replayed") is None]
    assert len(fresh) == 1
    assert effects(server, "race") == 1
    assert len(call(server, "GET", "/_admin/tickets")[2]["results"]) == 1


def test_storage_survives_restart(db_path):
    first = serve_in_thread("127.0.0.1", 0, db_path, api_key=API_KEY)
    try:
        _, _, ticket = create(first, "durable", X_Fencing_Token="3")
        _, _, ticket = call(
            first, "PATCH", f"/tickets/{ticket['id']}", {"status": "resolved"}, {"If-Match": '"1"'}
        )
    finally:
        first.shutdown()

    second = serve_in_thread("127.0.0.1", 0, db_path, api_key=API_KEY)
    try:
        status, headers, fetched = call(second, "GET", f"/tickets/{ticket['id']}")
        assert status == 200 and fetched == ticket and headers["ETag"] == '"2"'
        status, headers, _ = create(second, "durable")
        assert status == 201 and headers["Idempotent-Replayed"] == "true"
        assert create(second, "durable", X_Fencing_Token="2")[0] == 409
        assert effects(second, "durable") == 1
        assert create(second, "next")[2]["id"] == "REF-000002"
    finally:
        second.shutdown()


def test_unknown_route_and_wrong_method(server):
    assert call(server, "GET", "/nope")[::2] == (404, {"error": "not_found"})
    status, headers, body = call(server, "DELETE", "/tickets/REF-000001")
    assert status == 405 and body["error"] == "method_not_allowed"
    assert headers["Allow"] == "GET, PATCH"
    assert call(server, "PUT", "/healthz")[0] == 405


def test_body_digest_is_canonical_sha256():
    import hashlib

    expected = hashlib.sha256('{"a":"é","b":1}'.encode()).hexdigest()
    assert body_digest({"b": 1, "a": "é"}) == expected


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_runs_as_a_process_with_env_api_key(tmp_path):
    port = _free_port()
    env = {**os.environ, "REFSERVICE_API_KEY": "env-key"}
    cmd = [
        sys.executable,
        "-m",
        "tools.refservice",
        "--port",
        str(port),
        "--db",
        str(tmp_path / "t.sqlite3"),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                assert conn.getresponse().status == 200
                conn.close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    pytest.fail(f"service did not start: {proc.communicate()[0].decode()}")
                time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/_admin/tickets")
        assert conn.getresponse().status == 401
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/_admin/tickets", headers={"Authorization": "Bearer env-key"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.terminate()
        output = proc.communicate(timeout=10)[0].decode()
    assert proc.returncode == 0, output
    assert "listening on" in output


def test_same_key_while_in_flight_is_409_then_replays(server):
    call(server, "POST", "/_admin/faults", {"mode": "delay", "delay_seconds": 1.0})
    first = {}
    slow = threading.Thread(target=lambda: first.update(r=create(server, "in-flight", X_Fencing_Token="1")))
    slow.start()
    deadline = time.monotonic() + 10
    while "in-flight" not in server._inflight:  # until the delayed request holds the key
        assert time.monotonic() < deadline, "the delayed request never started"
        time.sleep(0.01)
    status, headers, body = create(server, "in-flight", X_Fencing_Token="1")
    assert (status, body["error"], headers["Retry-After"]) == (409, "request_in_progress", "1")
    # Other keys are not held up.
    assert create(server, "unrelated")[0] == 201
    slow.join()
    assert first["r"][0] == 201
    status, headers, _ = create(server, "in-flight", X_Fencing_Token="1")
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    assert effects(server, "in-flight") == 1


def test_tokenless_create_after_a_fence_is_refused(server):
    assert fence(server, "fenced-key", 3)[0] == 200
    status, _, body = create(server, "fenced-key")
    assert (status, body["error"]) == (409, "fencing_token_required")
    assert effects(server, "fenced-key") == 0
    # Keys never fenced still accept tokenless creates (and their replays).
    assert create(server, "plain")[0] == 201 and create(server, "plain")[0] == 201


def test_a_newer_storage_schema_is_not_opened(db_path):
    import sqlite3

    from tools.refservice.store import SCHEMA_VERSION, TicketStore

    TicketStore(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer than this code"):
        TicketStore(db_path)


def test_schema_2_files_get_the_fenced_at_column(db_path):
    import sqlite3

    from tools.refservice.store import FencingTokenRequired, TicketStore

    db_path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(db_path) as conn:
        conn.execute("CREATE TABLE fences (key TEXT PRIMARY KEY, highest_fencing_token INTEGER NOT NULL,"
                     " updated_at TEXT NOT NULL)")
        conn.execute("INSERT INTO fences VALUES ('k', 4, '2026-11-29T00:00:00Z')")
        conn.execute("PRAGMA user_version=2")
    store = TicketStore(db_path)
    assert store.fence("k", 4).highest_fencing_token == 4
    with pytest.raises(FencingTokenRequired):
        store.create_ticket("k", "digest", {"title": "t"}, None)


def comment(server, ticket_id, key, body="Rebooted; still failing.", **headers):
    extra = {name.replace("_", "-"): value for name, value in headers.items()}
    return call(server, "POST", f"/tickets/{ticket_id}/comments", {"body": body}, {"Idempotency-Key": key, **extra})


def test_comments_have_their_own_keys_and_replay(server):
    _, _, ticket = create(server, "for-comments")
    status, headers, first = comment(server, ticket["id"], "c-1", If_Match='"1"', X_Fencing_Token="1")
    assert status == 201 and first["ticket_version"] == 2 and headers["ETag"] == '"2"'
    assert first["comment"]["id"] == f"{ticket['id']}-C1" and first["comment"]["idempotency_key"] == "c-1"
    # The same key again: the stored response, no second comment.
    status, headers, again = comment(server, ticket["id"], "c-1", If_Match='"1"', X_Fencing_Token="1")
    assert (status, again, headers["Idempotent-Replayed"]) == (201, first, "true")
    # Another body or another ticket with the key: 422.
    assert comment(server, ticket["id"], "c-1", body="other text")[0] == 422
    _, _, other = create(server, "other-ticket")
    assert comment(server, other["id"], "c-1")[0] == 422
    # A stale If-Match: 412 with the current version; nothing appended.
    status, headers, body = comment(server, ticket["id"], "c-2", If_Match='"1"')
    assert (status, body["error"], body["current_version"]) == (412, "version_mismatch", 2)
    assert comment(server, "REF-999999", "c-3")[0] == 404
    assert comment(server, ticket["id"], "c-4", body="  ")[0] == 400
    _, _, fetched = call(server, "GET", f"/tickets/{ticket['id']}")
    assert [c["idempotency_key"] for c in fetched["comments"]] == ["c-1"] and fetched["version"] == 2
    assert effects(server, "c-1") == 1
    # Lookup by key (reconciliation), and the fence answers with the comment.
    _, _, found = call(server, "GET", f"/tickets/{ticket['id']}/comments?idempotency_key=c-1")
    assert found["results"] == [first]
    _, _, none = call(server, "GET", f"/tickets/{ticket['id']}/comments?idempotency_key=for-comments")
    assert none["results"] == []
    status, body = fence(server, "c-1", 2)
    assert status == 200 and body["ticket"] is None and body["comment"] == first
    assert comment(server, ticket["id"], "c-1", X_Fencing_Token="1")[0] == 409
