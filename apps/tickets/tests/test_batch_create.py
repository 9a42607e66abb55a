"""New tickets sent several to a request (``ReferenceTicketConnector.create_tickets``, the outbox's
bulk delivery): each item's outcome is decided by its own answer, exactly as if it had been sent
alone, and an answer that is not clearly that item's is ``OutcomeUnknown`` — never a receipt, never
"not executed"."""

from __future__ import annotations

import socket
import threading

import pytest

from apps.core import tool_errors as errors
from apps.tickets.connectors import Receipt, ReferenceTicketConnector
from apps.tickets.tests.test_connectors import PARAMS
from tests.gateway import destinations_allowed

KEYS = ["acme:ticket.create:a", "acme:ticket.create:b", "globex:ticket.create:c"]


def _items(keys=KEYS, token=1):
    return [(key, token, {**PARAMS, "title": f"{PARAMS['title']} ({key})"}) for key in keys]


def _ticket(key, number=1):
    return {"id": f"REF-{number:06d}", "version": 1, "status": "open", "idempotency_key": key}


def test_a_batch_makes_each_ticket_once_and_each_resend_replays(refservice, refadmin):
    connector = ReferenceTicketConnector()
    first = connector.create_tickets(_items(), timeout=5)
    assert all(isinstance(r, Receipt) for r in first)
    assert [r.body["idempotency_key"] for r in first] == KEYS and not any(r.replayed for r in first)
    assert len({r.external_id for r in first}) == 3
    alone = connector.create_ticket(idempotency_key=KEYS[1], fencing_token=2, params=_items()[1][2])
    assert (alone.external_id, alone.replayed) == (first[1].external_id, True)
    again = connector.create_tickets(_items(token=3), timeout=5)
    assert [(r.external_id, r.replayed) for r in again] == [(r.external_id, True) for r in first]
    assert [refadmin.effects(k) for k in KEYS] == [1, 1, 1]


def test_each_item_takes_the_error_class_of_its_own_answer(refservice, refadmin):
    connector = ReferenceTicketConnector()
    connector.fence(idempotency_key=KEYS[1], fencing_token=9)
    items = _items()
    items[2] = (KEYS[2], 1, {**PARAMS, "priority": "P9"})
    outcomes = connector.create_tickets(items, timeout=5)
    assert isinstance(outcomes[0], Receipt)
    assert isinstance(outcomes[1], errors.PreconditionFailed) and outcomes[1].body["highest"] == 9
    assert isinstance(outcomes[2], errors.InvalidParams)
    assert [refadmin.effects(k) for k in KEYS] == [1, 0, 0]


def _result(key, status=201, ticket_key=None, number=1, **extra):
    if status in (200, 201):
        return {"idempotency_key": key, "status": status, "replayed": False,
                "ticket": _ticket(ticket_key or key, number), **extra}
    return {"idempotency_key": key, "status": status, "error": "invalid_params", **extra}


def _outcomes(server_answering, results, keys=KEYS):
    url = server_answering({"POST /ticket-batches": (200, {"results": results})})
    return ReferenceTicketConnector(base_url=url).create_tickets(_items(keys), timeout=5)


def test_a_ticket_answering_another_key_or_a_key_answered_twice_is_unknown(server_answering):
    keys = KEYS + ["initech:ticket.create:d"]
    outcomes = _outcomes(server_answering, [
        _result(keys[0], number=1),
        _result(keys[1], number=2),
        _result(keys[2], ticket_key=keys[0], number=3),   # labelled c, the ticket is a's
        _result(keys[3], number=4), _result(keys[3], number=5),  # d answered twice
    ], keys)
    # five results for four items: nothing lines up, so each item needs exactly one ticket of its own
    assert isinstance(outcomes[1], Receipt) and outcomes[1].external_id == "REF-000002"
    assert [type(outcomes[i]) for i in (0, 2, 3)] == [errors.OutcomeUnknown] * 3  # a: two tickets claim it


def test_a_refusal_counts_only_when_the_answer_lines_up_with_the_items(server_answering):
    """The remote created a and c and refused b, but swapped a's and b's labels: the labels are all an
    error result has, so neither a nor b gets a definite outcome — a must never read "not executed"."""
    outcomes = _outcomes(server_answering, [_result(KEYS[1], status=400), _result(KEYS[0], ticket_key=KEYS[0]),
                                            _result(KEYS[2], number=3)])
    assert [type(o) for o in outcomes] == [Receipt, errors.OutcomeUnknown, Receipt]  # a: its ticket names it
    outcomes = _outcomes(server_answering, [_result(KEYS[1], status=400), _result(KEYS[0], status=400),
                                            _result(KEYS[2], number=3)])
    assert [type(o) for o in outcomes] == [errors.OutcomeUnknown, errors.OutcomeUnknown, Receipt]
    lined_up = _outcomes(server_answering, [_result(KEYS[0]), _result(KEYS[1], status=400), _result(KEYS[2], number=3)])
    assert [type(o) for o in lined_up] == [Receipt, errors.InvalidParams, Receipt]


def test_reordered_tickets_are_each_matched_to_the_key_they_name(server_answering):
    outcomes = _outcomes(server_answering, [_result(KEYS[2], number=3), _result(KEYS[0], number=1),
                                            _result(KEYS[1], number=2)])
    assert [o.external_id for o in outcomes] == ["REF-000001", "REF-000002", "REF-000003"]


@pytest.mark.parametrize("bad", [
    {"version": float("inf")}, {"version": "many"}, {"version": True}, {"id": 7}, {"id": ""}, {"ticket": None},
    {"status": True}, {"status": "201"}, {"status": 202}, {"status": 302}, {"status": None}, {"status": 201.0},
])
def test_one_unreadable_result_makes_that_item_unknown_and_no_other(server_answering, bad):
    middle = _result(KEYS[1], number=2)
    if "ticket" in bad:
        middle["ticket"] = bad["ticket"]
    elif "status" in bad:
        middle["status"] = bad["status"]
    else:
        middle["ticket"] = {**middle["ticket"], **bad}
    outcomes = _outcomes(server_answering, [_result(KEYS[0]), middle, _result(KEYS[2], number=3)])
    assert [type(o) for o in outcomes] == [Receipt, errors.OutcomeUnknown, Receipt]


@pytest.mark.parametrize("answer", [(200, {"results": "nope"}), (200, ["a list"]), (200, {}), (502, {"error": "x"}),
                                    (422, {"error": "idempotency_key_reused"}), (409, {"error": "conflict"}),
                                    (201, {"results": []}), (204, {})])
def test_a_batch_answer_without_results_is_unknown_for_every_item(server_answering, answer):
    url = server_answering({"POST /ticket-batches": answer})
    outcomes = ReferenceTicketConnector(base_url=url).create_tickets(_items(), timeout=5)
    assert [type(o) for o in outcomes] == [errors.OutcomeUnknown] * 3


@pytest.mark.parametrize(("status", "error_class"), [(503, errors.TemporarilyUnavailable),
                                                     (429, errors.TemporarilyUnavailable),
                                                     (401, errors.Unauthorized)])
def test_a_batch_refused_whole_gives_every_item_that_refusal(server_answering, status, error_class):
    url = server_answering({"POST /ticket-batches": (status, {"error": "no"})})
    outcomes = ReferenceTicketConnector(base_url=url).create_tickets(_items(), timeout=5)
    assert [type(o) for o in outcomes] == [error_class] * 3


def test_a_service_without_the_batch_endpoint_gets_each_create_alone(server_answering):
    url = server_answering({"POST /tickets": (201, _ticket(KEYS[0]))})  # /ticket-batches: 404
    connector = ReferenceTicketConnector(base_url=url)
    assert connector.batch_size > 1
    outcomes = connector.create_tickets(_items(KEYS[:2]), timeout=5)
    # each went alone to POST /tickets, which answered with the first key's ticket both times
    assert isinstance(outcomes[0], Receipt) and outcomes[0].body["idempotency_key"] == KEYS[0]
    assert isinstance(outcomes[1], errors.OutcomeUnknown)
    assert connector.batch_size == 1  # this process no longer tries the batch endpoint there


def test_a_batch_that_goes_unanswered_is_unknown_and_one_that_never_left_is_not_executed():
    listener = socket.create_server(("127.0.0.1", 0))

    def swallow():  # reads the request, closes without an answer
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)

    threading.Thread(target=swallow, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with destinations_allowed("ticket.reference", url):
            outcomes = ReferenceTicketConnector(base_url=url).create_tickets(_items(), timeout=2)
        assert [type(o) for o in outcomes] == [errors.OutcomeUnknown] * 3
    finally:
        listener.close()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    with destinations_allowed("ticket.reference", f"http://127.0.0.1:{port}"):
        outcomes = ReferenceTicketConnector(base_url=f"http://127.0.0.1:{port}").create_tickets(_items(), timeout=2)
    assert [type(o) for o in outcomes] == [errors.DefinitelyNotExecuted] * 3


def test_a_refusal_carrying_the_items_own_ticket_or_a_status_the_endpoint_never_gives_is_unknown(server_answering):
    with_ticket = {**_result(KEYS[1], status=422), "ticket": _ticket(KEYS[1], 2)}
    outcomes = _outcomes(server_answering, [_result(KEYS[0]), with_ticket, _result(KEYS[2], number=3)])
    assert [type(o) for o in outcomes] == [Receipt, errors.OutcomeUnknown, Receipt]
    for status in (401, 403, 404, 412, 429, 500):
        outcomes = _outcomes(server_answering, [_result(KEYS[0]), _result(KEYS[1], status=status),
                                                _result(KEYS[2], number=3)])
        assert type(outcomes[1]) is errors.OutcomeUnknown, status


def test_an_answer_that_cannot_be_read_never_escapes_the_batch(server_answering):
    nested = b"[" * 100_000 + b"]" * 100_000
    for status in (200, 503):
        url = server_answering({"POST /ticket-batches": (status, nested)})
        outcomes = ReferenceTicketConnector(base_url=url).create_tickets(_items(), timeout=5)
        assert len(outcomes) == 3 and all(isinstance(o, errors.ToolError) for o in outcomes)
        assert all(isinstance(o, (errors.OutcomeUnknown, errors.TemporarilyUnavailable)) for o in outcomes)


def test_an_unreadable_single_answer_after_a_refused_batch_is_that_items_alone(server_answering):
    """The batch is refused as such (400), so each item goes alone; the remote answers each create
    with a proxy's page: every item is unknown, and every item was sent."""
    url = server_answering({"POST /ticket-batches": (400, {"error": "invalid_params"}),
                            "POST /tickets": (201, b"<html>gateway</html>")})
    outcomes = ReferenceTicketConnector(base_url=url).create_tickets(_items(), timeout=5)
    assert [type(o) for o in outcomes] == [errors.OutcomeUnknown] * 3
