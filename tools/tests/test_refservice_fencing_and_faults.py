"""The reference ticket service (tools.refservice) under failure, over real HTTP: fencing tokens
that refuse a stale writer, concurrent and in-flight requests on one key, injected faults (drop after
commit, 503, delay), and storage that survives restarts and older or newer schema versions.

Stdlib only: each call opens a fresh ``http.client`` connection to a server running in a thread on
port 0 with a temporary SQLite file (``conftest.py``).
"""

import http.client
import threading
import time

import pytest

from tools.refservice import serve_in_thread
from tools.tests.refservice_http import API_KEY, TICKET, call, create, effects, fence


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


def test_tokenless_create_after_a_fence_is_refused(server):
    assert fence(server, "fenced-key", 3)[0] == 200
    status, _, body = create(server, "fenced-key")
    assert (status, body["error"]) == (409, "fencing_token_required")
    assert effects(server, "fenced-key") == 0
    # Keys never fenced still accept tokenless creates (and their replays).
    assert create(server, "plain")[0] == 201 and create(server, "plain")[0] == 201


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

