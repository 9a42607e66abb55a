"""Writes on an existing ticket through the connector (DESIGN.md §11; ADR 0011): comments carry
their own idempotency keys and, like updates, are conditional on the ticket's version — a 412 is a
``PreconditionFailed`` with the current version, never an overwrite. And the outbox keeps per-ticket
order: nothing for a ticket is claimed before its create was delivered, while unrelated tickets
proceed."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.actions.models import Action
from apps.agent.runner import agent_run, context_read
from apps.approvals.models import ApprovalPolicy
from apps.core import tool_errors as errors
from apps.outbox.dispatch import outbox_claim_batch
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks.services import task_submit
from apps.tickets.connectors import ReferenceTicketConnector
from tests.conftest import p, reads_run
from tests.factories import DeviceFactory
from tests.gateway import allow

PARAMS = {"title": "Fuser error on PRN-0417", "description": "Smeared pages after warm-up.", "priority": "P2",
          "device": "PRN-0417", "tenant": "acme", "requester": "riley", "labels": [], "evidence": ["kb/fuser"]}


def test_comment_with_its_own_key_is_conditional_and_replays(refservice, refadmin):
    connector = ReferenceTicketConnector()
    ticket = connector.create_ticket(idempotency_key="t-1", fencing_token=1, params=PARAMS)
    first = connector.add_comment(ticket_id=ticket.external_id, idempotency_key="t-1:c1", fencing_token=1,
                                  body="Replaced the fuser; monitoring.", if_match=1)
    assert (first.version, first.replayed, first.external_id) == (2, False, f"{ticket.external_id}-C1")
    again = connector.add_comment(ticket_id=ticket.external_id, idempotency_key="t-1:c1", fencing_token=1,
                                  body="Replaced the fuser; monitoring.", if_match=1)
    assert (again.external_id, again.version, again.replayed) == (first.external_id, 2, True)
    with pytest.raises(errors.PreconditionFailed) as stale:
        connector.add_comment(ticket_id=ticket.external_id, idempotency_key="t-1:c2", fencing_token=1,
                              body="A second note.", if_match=1)
    assert stale.value.status == 412 and stale.value.body["current_version"] == 2
    assert refadmin.effects("t-1:c1") == 1 and refadmin.effects("t-1:c2") == 0


def test_update_is_conditional_on_the_version(refservice):
    connector = ReferenceTicketConnector()
    ticket = connector.create_ticket(idempotency_key="t-2", fencing_token=1, params=PARAMS)
    updated = connector.update_ticket(ticket_id=ticket.external_id, if_match=1, changes={"status": "in_progress"})
    assert (updated.version, updated.status, updated.kind) == (2, "in_progress", "update")
    with pytest.raises(errors.PreconditionFailed) as stale:
        connector.update_ticket(ticket_id=ticket.external_id, if_match=1, changes={"status": "closed"})
    assert stale.value.body["current_version"] == 2
    assert connector.get_ticket(external_id=ticket.external_id)["status"] == "in_progress"
    with pytest.raises(errors.InvalidParams):
        connector.update_ticket(ticket_id=ticket.external_id, if_match=2, changes={"status": "bogus"})


@pytest.mark.allow_divergence  # the follow-up action is planted without its event, on purpose
def test_outbox_keeps_per_ticket_order_while_unrelated_tickets_proceed(tenant, requester, device, kb):
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "ticket.create": {"requires_approval": False, "ttl_minutes": 60}})
    rows = []
    for d in (device, DeviceFactory(tenant=tenant, asset_tag="PRN-0102")):
        task = task_submit(principal=p(requester), device_id=d.pk, symptom="Fuser error after warm-up.").task
        for _ in range(4):
            agent_run(task_id=task.pk)
            context_read(task_id=task.pk)
            reads_run(task.pk)  # the reads, each an activity of its own
        rows.append(OutboxMessage.objects.get(action__task=task))
    create, unrelated = rows
    # A later write on the first ticket shares its ordering key (the ticket's create key).
    first = create.action
    follow = Action.objects.create(tenant=tenant, task=first.task, tool=first.tool, tool_version=first.tool_version,
                                   params=first.params, params_digest="f" * 64, idempotency_key=first.idempotency_key
                                   + ":comment-1", object_version=first.object_version)
    later = OutboxMessage.objects.create(tenant=tenant, action=follow, ordering_key=create.ordering_key,
                                         available_at=timezone.now())
    claimed = {r.pk for r in outbox_claim_batch(owner="d1", limit=10)}
    assert claimed == {create.pk, unrelated.pk}, "the follow-up waits for its ticket's create"
    OutboxMessage.objects.filter(pk=create.pk).update(status=OutboxStatus.DELIVERED)
    assert [r.pk for r in outbox_claim_batch(owner="d2", limit=10)] == [later.pk]


def test_two_open_rows_of_one_ticket_made_in_the_same_microsecond_are_claimed_one_at_a_time(tenant, requester,
                                                                                            device, kb):
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "ticket.create": {"requires_approval": False, "ttl_minutes": 60}})
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    for _ in range(4):
        agent_run(task_id=task.pk)
        context_read(task_id=task.pk)
        reads_run(task.pk)  # the reads, each an activity of its own
    create = OutboxMessage.objects.get(action__task=task)
    first = create.action
    twins = []
    for n in (1, 2):
        follow = Action.objects.create(tenant=tenant, task=first.task, tool=first.tool, tool_version=first.tool_version,
                                       params=first.params, params_digest="f" * 64,
                                       idempotency_key=f"{first.idempotency_key}:comment-{n}",
                                       object_version=first.object_version)
        twins.append(OutboxMessage.objects.create(tenant=tenant, action=follow, ordering_key=create.ordering_key,
                                                  available_at=timezone.now()))
    OutboxMessage.objects.filter(pk=create.pk).update(status=OutboxStatus.DELIVERED)
    OutboxMessage.objects.filter(pk__in=[t.pk for t in twins]).update(created_at=timezone.now())
    [one] = outbox_claim_batch(owner="d1", limit=10)
    assert one.pk == min(t.pk for t in twins), "the same age: the lower id goes first, alone"
    assert outbox_claim_batch(owner="d2", limit=10) == []
    OutboxMessage.objects.filter(pk=one.pk).update(status=OutboxStatus.DELIVERED)
    assert [r.pk for r in outbox_claim_batch(owner="d3", limit=10)] == [max(t.pk for t in twins)]


def test_an_answer_naming_another_idempotency_key_is_never_a_receipt(server_answering):
    other = {"id": "REF-000001", "version": 1, "status": "open", "idempotency_key": "acme:ticket.create:other"}
    url = server_answering({"POST /tickets": (201, other), "GET /tickets": (200, {"results": [other]}),
                            "POST /fences": (200, {"idempotency_key": "globex:ticket.create:mine",
                                                   "highest_fencing_token": 2, "ticket": other})})
    connector = ReferenceTicketConnector(base_url=url)
    with pytest.raises(errors.OutcomeUnknown, match="another idempotency key"):
        connector.create_ticket(idempotency_key="globex:ticket.create:mine", fencing_token=1, params={"title": "x"})
    with pytest.raises(errors.OutcomeUnknown, match="another idempotency key"):
        connector.lookup_by_key(idempotency_key="globex:ticket.create:mine")
    with pytest.raises(errors.OutcomeUnknown, match="another idempotency key"):
        connector.fence(idempotency_key="globex:ticket.create:mine", fencing_token=2)
    mine = {**other, "idempotency_key": "globex:ticket.create:mine"}
    url = server_answering({"POST /tickets": (201, mine)})
    receipt = ReferenceTicketConnector(base_url=url).create_ticket(
        idempotency_key="globex:ticket.create:mine", fencing_token=1, params={"title": "x"})
    assert receipt.external_id == "REF-000001"


def test_an_interim_answer_is_never_taken_for_the_answer_or_left_for_the_next_request(settings):
    """A ``102 Processing`` / ``103 Early Hints`` before the real answer, on a kept-alive connection:
    each create gets its own ticket (the transport reads past interim answers; an answer left on the
    connection would be the next request's receipt — another tenant's ticket)."""
    import json
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))

    def serve(conn):
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (line.partition(b":") for line in head.split(b"\r\n")[1:])}
                length = int(headers.get(b"content-length", b"0"))
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                key = headers[b"idempotency-key"].decode()
                conn.sendall(b"HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
                time.sleep(0.1)
                body = json.dumps({"id": f"REF-{key}", "version": 1, "status": "open", "idempotency_key": key}).encode()
                conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        allow(settings, "ticket.reference", url)
        connector = ReferenceTicketConnector(base_url=url)
        connector.keep_alive = True
        for key in ("acme:ticket.create:a", "globex:ticket.create:b"):
            receipt = connector.create_ticket(idempotency_key=key, fencing_token=1, params={"title": "x"})
            assert receipt.external_id == f"REF-{key}"
    finally:
        listener.close()


@pytest.mark.parametrize("answer", [
    {},
    {"idempotency_key": "acme:ticket.create:other", "highest_fencing_token": 5, "ticket": None},
    {"idempotency_key": "acme:ticket.create:mine", "highest_fencing_token": 4, "ticket": None},
    {"idempotency_key": "acme:ticket.create:mine", "highest_fencing_token": True, "ticket": None},
    {"idempotency_key": "acme:ticket.create:mine", "ticket": None},
    [],
    b"<html>ok</html>",
])
def test_nothing_found_is_only_read_from_this_keys_fence_at_this_token(server_answering, answer):
    """A fence that finds no ticket is what lets "not executed" be recorded: an answer that is not
    the fence of this key at this token (or above) is ``OutcomeUnknown``, never "nothing found"."""
    url = server_answering({"POST /fences": (200, answer)})
    with pytest.raises(errors.OutcomeUnknown):
        ReferenceTicketConnector(base_url=url).fence(idempotency_key="acme:ticket.create:mine",
                                                                  fencing_token=5)
    mine = {"idempotency_key": "acme:ticket.create:mine", "highest_fencing_token": 6, "ticket": None}
    url = server_answering({"POST /fences": (200, mine)})
    assert ReferenceTicketConnector(base_url=url).fence(
        idempotency_key="acme:ticket.create:mine", fencing_token=5) is None


@pytest.mark.parametrize("answer", [{}, {"results": None}, {"results": "none"}, [], b"<html>ok</html>",
                                    {"results": [{"id": "REF-000009", "version": 1,
                                                  "idempotency_key": "acme:ticket.create:other"}]}])
def test_nothing_found_is_only_read_from_a_lookup_answer_that_says_so(server_answering, answer):
    from apps.tickets.connectors import HelpdeskConnector

    url = server_answering({"GET /tickets": (200, answer)})
    with pytest.raises(errors.OutcomeUnknown):
        ReferenceTicketConnector(base_url=url).lookup_by_key(idempotency_key="acme:ticket.create:mine")
    helpdesk_answer = answer
    if isinstance(answer, dict) and isinstance(answer.get("results"), list):
        helpdesk_answer = {"results": [{"id": 9, "status": 1, "custom_faultdesk_key": "acme:ticket.create:other"}]}
    url = server_answering({"GET /helpdesk/api/faultdesk/tickets/by-custom-field/": (200, helpdesk_answer)})
    with pytest.raises(errors.OutcomeUnknown):
        HelpdeskConnector(base_url=url).lookup_by_key(idempotency_key="acme:ticket.create:mine")
    url = server_answering({"GET /tickets": (200, {"results": []})})
    assert ReferenceTicketConnector(base_url=url).lookup_by_key(
        idempotency_key="acme:ticket.create:mine") is None
