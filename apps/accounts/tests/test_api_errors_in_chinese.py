"""API refusals speak the reader's language (apps/accounts/language.py): with ``Accept-Language:
zh-Hans`` the ``detail`` of a refusal is Simplified Chinese, its machine-readable ``error`` code (and
every other field) the same as in English; without the header it is English. Covers a domain
error of a service (404, 422, 429), a DRF validation message, and the JSON errors the middlewares
answer — also one answered before ``LocaleMiddleware`` runs, which must not keep the language an
earlier request left in the thread."""

from __future__ import annotations

import uuid

import pytest
from django.test import Client
from django.utils import translation

from apps.tasks.models import Task

ZH = {"HTTP_ACCEPT_LANGUAGE": "zh-Hans"}


@pytest.fixture(autouse=True)
def _english_afterwards():
    """A request leaves its language active in the thread: later tests call services directly."""
    yield
    translation.deactivate()


def _signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _post_task(client, body, **headers):
    return client.post("/api/tasks/", body, content_type="application/json", **headers)


def test_an_unknown_task_is_the_same_404_in_chinese_and_in_english(requester):
    client = _signed_in(requester)
    path = f"/api/tasks/{uuid.uuid4()}/"
    zh, en = client.get(path, **ZH), client.get(path)
    assert zh.status_code == en.status_code == 404
    assert zh["Content-Language"] == "zh-hans" and en["Content-Language"] == "en"
    assert zh.json() == {"error": "not_found", "detail": "找不到该任务"}
    assert en.json() == {"error": "not_found", "detail": "task not found"}


def test_a_device_outside_the_tenant_is_refused_in_the_readers_language(requester, device):
    client = _signed_in(requester)
    body = {"device_id": 999999, "symptom": "Paper jam in tray 2"}
    zh, en = _post_task(client, body, **ZH), _post_task(client, body)
    assert zh.status_code == en.status_code == 404
    assert zh.json() == {"error": "not_found", "detail": "找不到设备 999999"}
    assert en.json() == {"error": "not_found", "detail": "device 999999 not found"}
    assert not Task.objects.exists()


def test_a_field_validation_error_keeps_its_shape_and_is_translated(requester, device):
    client = _signed_in(requester)
    body = {"device_id": "abc", "symptom": "Paper jam in tray 2"}
    zh, en = _post_task(client, body, **ZH), _post_task(client, body)
    assert zh.status_code == en.status_code == 400
    assert zh.json() == {"device_id": ["请填写合法的整数值。"]}  # DRF's own catalogue
    assert en.json() == {"device_id": ["A valid integer is required."]}
    assert not Task.objects.exists()


def test_an_idempotency_key_reused_with_another_body_is_the_same_422(requester, device):
    client = _signed_in(requester)
    first = _post_task(client, {"device_id": device.pk, "symptom": "Fuser error"}, HTTP_IDEMPOTENCY_KEY="k-zh")
    assert first.status_code == 201
    other = {"device_id": device.pk, "symptom": "Fuser error", "urgency": "low"}
    zh = _post_task(client, other, HTTP_IDEMPOTENCY_KEY="k-zh", **ZH)
    en = _post_task(client, other, HTTP_IDEMPOTENCY_KEY="k-zh")
    assert zh.status_code == en.status_code == 422
    assert zh.json() == {"error": "unprocessable", "task_id": first.json()["id"],
                         "detail": "该 Idempotency-Key（幂等键）已用于另一个不同的请求体"}
    assert en.json() == {"error": "unprocessable", "task_id": first.json()["id"],
                         "detail": "Idempotency-Key was already used with a different request body"}
    assert Task.objects.count() == 1


def test_the_open_request_quota_is_the_same_429_in_chinese(requester, device):
    tenant = device.tenant
    tenant.max_active_tasks = 1
    tenant.save()
    client = _signed_in(requester)
    assert _post_task(client, {"device_id": device.pk, "symptom": "Fault number 1"}).status_code == 201
    body = {"device_id": device.pk, "symptom": "Fault number 2"}
    zh, en = _post_task(client, body, **ZH), _post_task(client, body)
    assert zh.status_code == en.status_code == 429
    assert zh["Retry-After"] == en["Retry-After"] == "60"
    assert zh.json() == {"error": "quota_exceeded", "retry_after": 60,
                         "detail": "该租户已有 1 个进行中的请求（上限为 1 个）；请等待其完成，或将其取消"}
    assert en.json() == {"error": "quota_exceeded", "retry_after": 60,
                         "detail": "this tenant already has 1 open request (limit 1); wait for one to finish, "
                                   "or cancel one"}
    assert Task.objects.count() == 1


def test_a_route_that_does_not_match_is_a_json_404_in_the_readers_language(requester):
    client = _signed_in(requester)
    zh, en = client.get("/api/nope/", **ZH), client.get("/api/nope/")
    assert zh.status_code == en.status_code == 404
    assert zh.json() == {"error": "not_found", "detail": "资源不存在：/api/nope/"}
    assert en.json() == {"error": "not_found", "detail": "no such resource: /api/nope/"}


def test_a_refusal_before_the_locale_middleware_uses_the_requests_own_language(requester):
    client = _signed_in(requester)

    def malformed(**headers):
        return client.post("/api/tasks/", data=b"{}", content_type="application/json", CONTENT_LENGTH="abc",
                           **headers)

    assert client.get("/api/nope/", **ZH)["Content-Language"] == "zh-hans"  # leaves Chinese active in the thread
    en = malformed()  # … which this request, without the header, must not speak
    zh = malformed(**ZH)
    assert zh.status_code == en.status_code == 400
    assert zh.json() == {"error": "invalid_input", "detail": "Content-Length 必须是非负整数"}
    assert en.json() == {"error": "invalid_input", "detail": "Content-Length must be a non-negative integer"}
