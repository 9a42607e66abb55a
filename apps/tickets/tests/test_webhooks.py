"""Signed webhooks from the reference ticket service to faultdesk (DESIGN.md §11): the service signs
and retries; faultdesk authenticates, deduplicates, correlates and applies only newer versions; a
forged, replayed or uncorrelated delivery changes nothing and is recorded."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from django.urls import reverse

from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.tasks.services import task_submit
from apps.tickets.models import InboundWebhook, TicketMirror, WebhookOutcome
from apps.tickets.webhook_signature import sign, verify
from tests.conftest import drive, p
from tools.refservice import serve_in_thread
from tools.refservice.webhooks import event_body

SECRET = "test-webhook-secret"


@pytest.fixture(autouse=True)
def _secret(settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_WEBHOOK_SECRET": SECRET}


@pytest.fixture
def mirror(requester, approver, device, kb, refservice):
    """A completed task whose ticket is mirrored at version 1."""
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    task = drive(task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    drive(task.pk)
    return TicketMirror.objects.get(action__task=task)


def _event(mirror, **overrides):
    return {"event_id": "ev-1", "type": "ticket.status_changed", "ticket_id": mirror.external_id,
            "idempotency_key": mirror.action.idempotency_key, "version": 2, "status": "resolved",
            "previous_status": "open", "occurred_at": "2026-11-29T00:00:00.000Z", **overrides}


def _post(client, event=None, *, raw=None, secret=SECRET, timestamp=None, signature=None):
    body = raw if raw is not None else event_body(event).encode()
    headers = {"HTTP_X_REFSERVICE_SIGNATURE": signature if signature is not None else sign(secret, body, timestamp)}
    return client.post(reverse("webhook-reference"), data=body, content_type="application/json", **headers)


def test_signed_newer_event_updates_the_mirror_once(client, mirror, admin_user):
    resp = _post(client, _event(mirror))
    assert (resp.status_code, resp.json()) == (200, {"status": "applied"})
    # The admin's trace of the task shows the ticket's later life.
    client.force_login(admin_user)
    trace = client.get(reverse("task-trace", args=[mirror.action.task_id])).content.decode()
    assert "<code>ev-1</code> · APPLIED · open → resolved (v2)" in trace
    client.logout()
    mirror.refresh_from_db()
    assert (mirror.status, mirror.external_version) == ("resolved", 2)
    hook = InboundWebhook.objects.get(event_id="ev-1", outcome=WebhookOutcome.APPLIED)
    assert hook.verified and hook.action_id == mirror.action_id and hook.tenant_id == mirror.tenant_id
    # The same delivery again (a retry or a replay within the tolerance): acknowledged, no change.
    resp = _post(client, _event(mirror, status="closed"))
    assert (resp.status_code, resp.json()) == (200, {"status": "duplicate"})
    mirror.refresh_from_db()
    assert mirror.status == "resolved"


def test_out_of_order_event_is_stale(client, mirror):
    assert _post(client, _event(mirror, event_id="ev-3", version=3, status="closed")).json()["status"] == "applied"
    resp = _post(client, _event(mirror, event_id="ev-2", version=2, status="resolved"))
    assert resp.json() == {"status": "stale"}
    mirror.refresh_from_db()
    assert (mirror.status, mirror.external_version) == ("closed", 3)


@pytest.mark.parametrize("case", ["wrong secret", "missing", "malformed header", "expired", "tampered body"])
def test_forged_or_replayed_deliveries_change_nothing(client, mirror, case):
    event = _event(mirror)
    body = event_body(event).encode()
    kwargs = {
        "wrong secret": {"secret": "guess"},
        "missing": {"signature": ""},
        "malformed header": {"signature": "v1=abc"},
        "expired": {"timestamp": time.time() - 3600},
        "tampered body": {"raw": event_body({**event, "status": "closed"}).encode(),
                          "signature": sign(SECRET, body)},
    }[case]
    resp = _post(client, event, **kwargs)
    assert resp.status_code == 401 and resp.json()["error"] == "invalid_signature"
    mirror.refresh_from_db()
    assert (mirror.status, mirror.external_version) == ("open", 1)
    assert not InboundWebhook.objects.exists(), "an unauthenticated delivery is logged, never stored"


def test_uncorrelated_and_malformed_deliveries_change_nothing(client, mirror):
    resp = _post(client, _event(mirror, event_id="ev-x", ticket_id="REF-999999"))
    assert (resp.status_code, resp.json()) == (202, {"status": "uncorrelated"})
    resp = _post(client, _event(mirror, event_id="ev-y", idempotency_key="acme:ticket.create:someone-else"))
    assert resp.status_code == 202
    resp = _post(client, raw=b'{"event_id": "ev-z"}')
    assert resp.status_code == 400 and resp.json()["error"] == "malformed"
    resp = _post(client, raw=b"not json")
    assert resp.status_code == 400
    # Signed, but with values no ticket has: a clear 400, never a 500.
    for bad in ({"version": 10**30}, {"version": 2.9}, {"version": True}, {"status": "open\u0000"},
                {"event_id": 7}, {"ticket_id": "x" * 300}):
        resp = _post(client, raw=event_body({**_event(mirror), "event_id": "ev-bad", **bad}).encode())
        assert resp.status_code == 400, bad
    resp = _post(client, raw=b'{"event_id": "ev-inf", "version": Infinity}')
    assert resp.status_code == 400
    mirror.refresh_from_db()
    assert (mirror.status, mirror.external_version) == ("open", 1)
    assert sorted(InboundWebhook.objects.values_list("outcome", flat=True)) == [
        "MALFORMED"] * 9 + ["UNCORRELATED", "UNCORRELATED"]
    assert client.get(reverse("webhook-reference")).status_code == 405


class _Capture(BaseHTTPRequestHandler):
    """A receiver that fails the first delivery (500) and records the rest."""

    deliveries: list = []
    fail_first = True

    def do_POST(self):  # noqa: N802 - the stdlib's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).fail_first:
            type(self).fail_first = False
            self.send_response(500)
            self.end_headers()
            return
        type(self).deliveries.append((body, dict(self.headers)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_service_signs_and_retries_and_faultdesk_applies_the_delivery(client, mirror, tmp_path):
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    _Capture.deliveries, _Capture.fail_first = [], True
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    service = serve_in_thread("127.0.0.1", 0, str(tmp_path / "hooks.sqlite3"), api_key="k",
                              webhook_url=f"http://127.0.0.1:{receiver.server_address[1]}/", webhook_secret=SECRET)
    try:
        api = httpx.Client(base_url=service.url, headers={"Authorization": "Bearer k"}, timeout=5)
        ticket = api.post("/tickets", json={"title": "Fuser error", "priority": "P2", "device": "PRN-0417",
                                            "tenant": "acme"}, headers={"Idempotency-Key": "hook-key"}).json()
        assert api.patch(f"/tickets/{ticket['id']}", json={"priority": "P1"}, headers={"If-Match": '"1"'}).is_success
        assert api.patch(f"/tickets/{ticket['id']}", json={"status": "resolved"},
                         headers={"If-Match": '"2"'}).is_success
        deadline = time.monotonic() + 15
        while not _Capture.deliveries:  # first try answered 500: redelivered after the backoff
            assert time.monotonic() < deadline, "the webhook was never redelivered"
            time.sleep(0.05)
        [(body, headers)] = _Capture.deliveries  # the priority change sent nothing
        event = json.loads(body)
        assert (event["type"], event["ticket_id"], event["version"], event["status"], event["previous_status"]) == (
            "ticket.status_changed", ticket["id"], 3, "resolved", "open")
        assert headers["X-Refservice-Event-Id"] == event["event_id"]
        assert verify(SECRET, body, headers["X-Refservice-Signature"]) == (True, "")
        # The receiver has the body before the service has recorded the answer to it: wait for that.
        while True:
            [stored] = api.get("/_admin/webhooks").json()["results"]
            if stored["delivered_at"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stored["attempts"] == 2 and stored["delivered_at"] and stored["last_status"] == "2xx"
    finally:
        service.shutdown()
        receiver.shutdown()
    # Delivered to faultdesk as received, it is authentic but correlates to no action of ours.
    resp = client.post(reverse("webhook-reference"), data=body, content_type="application/json",
                       HTTP_X_REFSERVICE_SIGNATURE=headers["X-Refservice-Signature"])
    assert resp.status_code == 202
    # The same path for our own ticket applies it.
    own = _event(mirror, event_id=event["event_id"] + "-own")
    assert _post(client, own).json() == {"status": "applied"}
