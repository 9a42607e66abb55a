"""The reference ticket service's HTTP API (tools.refservice), over real HTTP: creating, reading
and updating tickets, idempotency keys and their replays, authentication, comments, unknown routes,
and the service run as its own process.

Stdlib only: each call opens a fresh ``http.client`` connection to a server running in a thread on
port 0 with a temporary SQLite file (``conftest.py``).
"""

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.refservice import serve_in_thread
from tools.refservice.validation import body_digest
from tools.tests.refservice_http import TICKET, call, comment, create, effects, fence

REPO_ROOT = Path(__file__).resolve().parents[2]


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



@pytest.mark.parametrize("due", ["2026-12-07T17:00:00+00:00", "2026-12-07T09:00:00+08:00"])
def test_a_ticket_keeps_the_due_date_it_was_created_with(server, due):
    status, _headers, ticket = create(server, f"due-{due}", {**TICKET, "due_at": due})
    assert status == 201 and ticket["due_at"] == due
    assert call(server, "GET", f"/tickets/{ticket['id']}")[2]["due_at"] == due


@pytest.mark.parametrize("due", ["tomorrow", "2026-12-07T17:00:00", "2026-13-07T17:00:00+00:00", 1733590800,
                                 "2026-12-07T17:00:00+00:00" + " " * 40])
def test_a_due_date_that_is_not_an_aware_iso_datetime_is_a_clear_400(server, due):
    status, _headers, body = create(server, "due-bad", {**TICKET, "due_at": due})
    assert status == 400 and body["error"] == "invalid_params" and body["detail"].startswith("due_at:")
    assert effects(server, "due-bad") == 0


def test_a_ticket_without_a_due_date_has_none(server):
    status, _headers, ticket = create(server, "due-none")
    assert status == 201 and "due_at" not in ticket
