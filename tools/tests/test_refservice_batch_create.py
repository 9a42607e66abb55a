"""``POST /ticket-batches`` of the reference ticket service, over real HTTP: each item is handled
exactly as its own ``POST /tickets`` — its idempotency key (a batch item and a single create with
the same key and body are one request), its fencing token, its validation, its armed fault — and a
malformed batch changes nothing."""

import http.client

import pytest

from tools.refservice.routes import MAX_BATCH_ITEMS
from tools.tests.refservice_http import TICKET, call, create, effects, fence


def batch(server, items):
    """POST /ticket-batches with ``items`` as ``[(key, token, ticket)]``; returns (status, body)."""
    body = {"items": [{"idempotency_key": k, "fencing_token": t, "ticket": b} for k, t, b in items]}
    status, _, answer = call(server, "POST", "/ticket-batches", body)
    return status, answer


def tickets(server):
    return call(server, "GET", "/_admin/tickets")[2]["results"]


def test_each_item_is_created_once_and_replays_alone_or_in_a_batch(server):
    status, body = batch(server, [("b-1", 1, TICKET), ("b-2", 1, {**TICKET, "title": "打印机卡纸"}),
                                  ("b-3", None, TICKET)])
    assert status == 200
    results = body["results"]
    assert [r["idempotency_key"] for r in results] == ["b-1", "b-2", "b-3"]
    assert [r["status"] for r in results] == [201, 201, 201] and not any(r["replayed"] for r in results)
    assert [r["ticket"]["idempotency_key"] for r in results] == ["b-1", "b-2", "b-3"]
    assert results[1]["ticket"]["title"] == "打印机卡纸"
    assert len({r["ticket"]["id"] for r in results}) == 3

    # the same key and body sent alone is the same request: the stored ticket, replayed
    status, headers, alone = create(server, "b-2", {**TICKET, "title": "打印机卡纸"}, X_Fencing_Token="1")
    assert status == 201 and headers["Idempotent-Replayed"] == "true" and alone == results[1]["ticket"]
    # and a single create first, then the batch: replayed in the batch
    create(server, "b-4")
    status, again = batch(server, [("b-1", 2, TICKET), ("b-4", None, TICKET)])
    assert [(r["status"], r["replayed"]) for r in again["results"]] == [(201, True), (201, True)]
    assert again["results"][0]["ticket"] == results[0]["ticket"]
    assert [effects(server, k) for k in ("b-1", "b-2", "b-3", "b-4")] == [1, 1, 1, 1]
    assert len(tickets(server)) == 4


def test_each_item_gets_the_answer_its_own_create_would_get(server):
    create(server, "reused")
    assert fence(server, "fenced", 5)[0] == 200
    status, body = batch(server, [
        ("fine", 1, TICKET),
        ("fenced", 4, TICKET),                       # below the key's fence: refused
        ("no-title", 1, {**TICKET, "title": ""}),    # invalid body
        ("reused", None, {**TICKET, "priority": "P1"}),  # the key with another body
        ("not-an-object", 1, ["x"]),
    ])
    assert status == 200
    answers = {r["idempotency_key"]: r for r in body["results"]}
    assert answers["fine"]["status"] == 201
    assert (answers["fenced"]["status"], answers["fenced"]["error"], answers["fenced"]["highest"]) == (
        409, "stale_fencing_token", 5)
    assert (answers["no-title"]["status"], answers["no-title"]["error"]) == (400, "invalid_params")
    assert (answers["reused"]["status"], answers["reused"]["error"]) == (422, "idempotency_key_reused")
    assert (answers["not-an-object"]["status"], answers["not-an-object"]["error"]) == (400, "invalid_params")
    assert [effects(server, k) for k in ("fine", "fenced", "no-title", "reused", "not-an-object")] == [1, 0, 0, 1, 0]


@pytest.mark.parametrize("body", [
    {"items": []},
    {"items": [{"idempotency_key": f"k{i}", "ticket": TICKET} for i in range(MAX_BATCH_ITEMS + 1)]},
    {"items": [{"idempotency_key": "twice", "ticket": TICKET}, {"idempotency_key": "twice", "ticket": TICKET}]},
    {"items": [{"idempotency_key": "ok", "ticket": TICKET}, {"ticket": TICKET}]},
    {"items": [{"idempotency_key": "ok", "ticket": TICKET}, {"idempotency_key": "bad key", "ticket": TICKET}]},
    {"items": [{"idempotency_key": "ok", "ticket": TICKET, "fencing_token": -1}]},
    {"items": [{"idempotency_key": "ok", "ticket": TICKET, "fencing_token": True}]},
    {"items": [{"idempotency_key": "ok", "ticket": TICKET, "fencing_token": "3"}]},
    {"items": [{"idempotency_key": "ok", "ticket": TICKET, "extra": 1}]},
    {"items": [["ok", TICKET]]},
    {"items": {"idempotency_key": "ok", "ticket": TICKET}},
    {"items": [], "more": 1},
    {},
], ids=["empty", "too-many", "key-twice", "key-missing", "key-invalid", "negative-token", "bool-token",
        "string-token", "unknown-field", "item-not-object", "items-not-list", "unknown-top-field", "no-items"])
def test_a_malformed_batch_is_refused_whole_and_changes_nothing(server, body):
    status, _, answer = call(server, "POST", "/ticket-batches", body)
    assert status == 400 and answer["error"] in ("invalid_params", "idempotency_key_required")
    assert tickets(server) == []


def test_a_batch_needs_the_api_key(server):
    status, _, answer = call(server, "POST", "/ticket-batches", {"items": [{"idempotency_key": "k", "ticket": TICKET}]},
                             auth=False)
    assert (status, answer["error"]) == (401, "unauthorized") and tickets(server) == []


def test_a_fault_applies_to_the_items_it_is_armed_for(server):
    call(server, "POST", "/_admin/faults", {"mode": "fail_503", "count": 1})
    status, body = batch(server, [("first", 1, TICKET), ("second", 1, TICKET)])
    assert status == 200
    assert [(r["status"], r.get("error")) for r in body["results"]] == [(503, "temporarily_unavailable"), (201, None)]
    assert effects(server, "first") == 0 and effects(server, "second") == 1


def test_a_lost_answer_of_a_batch_lost_nothing_the_batch_did(server):
    """``drop_after_commit`` taken by one item: every item is committed, the answer never comes; the
    same batch again replays every ticket, none twice."""
    call(server, "POST", "/_admin/faults", {"mode": "drop_after_commit"})
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        batch(server, [("lost-1", 1, TICKET), ("lost-2", 1, TICKET)])
    assert [effects(server, k) for k in ("lost-1", "lost-2")] == [1, 1]
    status, body = batch(server, [("lost-1", 1, TICKET), ("lost-2", 1, TICKET)])
    assert status == 200 and all(r["replayed"] for r in body["results"])
    assert [effects(server, k) for k in ("lost-1", "lost-2")] == [1, 1] and len(tickets(server)) == 2
