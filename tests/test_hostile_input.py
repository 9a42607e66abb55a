"""Hostile input from anyone gets a clear 4xx and leaves nothing behind: a non-ASCII webhook
signature, a Content-Length that is not a number, JSON nested past what anything here walks,
and floods of unsigned webhooks (logged, never stored)."""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from apps.tasks.models import Task
from apps.tickets.models import InboundWebhook
from apps.tickets.webhook_signature import sign

SECRET = "test-webhook-secret-of-32-characters-x"


@pytest.fixture(autouse=True)
def _secret(settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_WEBHOOK_SECRET": SECRET}


def _webhook(client, body: bytes, signature: str, **extra):
    return client.post(reverse("webhook-reference"), data=body, content_type="application/json",
                       HTTP_X_REFSERVICE_SIGNATURE=signature, **extra)


def test_a_non_ascii_signature_is_a_401_not_a_500(client, db):
    resp = _webhook(client, b'{"event_id": "x"}', f"t={int(time.time())},v1=\u00e9\u00e9\u00e9")
    assert resp.status_code == 401 and resp.json()["error"] == "invalid_signature"


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", "12 34", "\u0663"])
def test_a_malformed_content_length_is_a_400_everywhere(client, requester, length):
    resp = _webhook(client, b"{}", "t=1,v1=00", CONTENT_LENGTH=length)
    assert resp.status_code == 400 and resp.json()["error"] == "invalid_input"
    client.force_login(requester)
    resp = client.post("/api/tasks/", data=b"{}", content_type="application/json", CONTENT_LENGTH=length)
    assert resp.status_code == 400 and "Content-Length" in resp.json()["detail"]


@pytest.mark.parametrize("depth", [40, 5_000])  # 5,000: past the decoder's own recursion limit
def test_deeply_nested_json_is_a_400_on_the_webhook_and_the_api(client, requester, device, depth):
    nested = ("[" * depth + "]" * depth).encode()
    resp = _webhook(client, nested, sign(SECRET, nested))
    assert resp.status_code == 400 and resp.json()["error"] == "malformed"
    client.force_login(requester)
    body = b'{"device_id": %d, "symptom": "fuser", "extra": ' % device.pk + nested + b"}"
    resp = client.post("/api/tasks/", data=body, content_type="application/json")
    assert resp.status_code == 400 and "nested" in resp.json()["detail"]
    assert not Task.objects.exists()


def test_unsigned_webhooks_are_logged_not_stored(client, db, caplog):
    for i in range(30):
        resp = _webhook(client, b"x" * 1000 + str(i).encode(), "t=1,v1=00")
        assert resp.status_code == 401
    assert InboundWebhook.objects.count() == 0
    assert sum("rejected" in r.getMessage() for r in caplog.records) == 30


def test_an_api_body_over_the_size_limit_is_the_apis_json_413(client, requester, settings):
    client.force_login(requester)
    big = b'{"symptom": "' + b"x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1) + b'"}'
    resp = client.post("/api/tasks/", data=big, content_type="application/json")
    assert resp.status_code == 413 and resp.json()["error"] == "too_large"
    assert not Task.objects.exists()


@pytest.mark.parametrize("t", ["1" * 400, "-" + "9" * 400, "\u0661\u0662"])
def test_a_signature_time_out_of_any_range_is_a_401(client, db, t):
    resp = _webhook(client, b"{}", f"t={t},v1=abc")
    assert resp.status_code == 401 and resp.json()["detail"] == "signature malformed"


@pytest.mark.parametrize("username", ["u" * 256, "u" * 5000])
def test_an_overlong_username_is_refused_not_a_500(client, db, username):
    import base64

    assert client.post("/login/", {"username": username, "password": "x"}).status_code == 200
    assert client.post("/django-admin/login/", {"username": username, "password": "x"}).status_code == 200
    auth = "Basic " + base64.b64encode(f"{username}:x".encode()).decode()
    assert client.get("/api/tasks/", HTTP_AUTHORIZATION=auth).status_code == 403


def test_a_basic_username_with_a_nul_is_refused_not_a_500(client, requester):
    import base64

    auth = "Basic " + base64.b64encode(b"ri\x00ley:pw-for-tests").decode()
    resp = client.get("/api/tasks/", HTTP_AUTHORIZATION=auth)
    assert resp.status_code == 403 and resp.json()["error"] == "authentication_failed"


@pytest.mark.parametrize("raw", [b'{"event_id": "e", "x": "\\u0000"}', b'{"event_id": "e", "x": 1e999}',
                                 b'{"event_id": "e", "x": NaN}', b'{"event_id": "e\x00", "x": [}'])
def test_a_signed_webhook_with_values_postgresql_cannot_store_is_a_400(client, db, raw):
    resp = _webhook(client, raw, sign(SECRET, raw))
    assert resp.status_code == 400 and resp.json()["error"] == "malformed"
    assert InboundWebhook.objects.get().outcome == "MALFORMED"
