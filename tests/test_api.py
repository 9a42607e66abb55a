"""The HTTP API (DESIGN.md §1 step 1, §7): Idempotency-Key semantics, validation errors as clear
4xx, tenant isolation, approval decisions (one wins, the others 409), the OpenAPI schema."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from rest_framework.test import APIClient

from apps.approvals.models import ApprovalRequest
from apps.tasks.models import Task
from tests.conftest import drive

BODY = {"symptom": "Fuser error after warm-up; smeared pages.", "urgency": "high"}


def client_for(user):
    c = APIClient()
    c.force_authenticate(user)
    return c


def test_same_idempotency_key_returns_the_same_task(requester, device):
    c = client_for(requester)
    first = c.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    again = c.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert Task.objects.count() == 1


def test_same_key_with_a_different_body_is_422(requester, device):
    c = client_for(requester)
    c.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json", HTTP_IDEMPOTENCY_KEY="k-2")
    resp = c.post("/api/tasks/", {**BODY, "device_id": device.pk, "urgency": "low"}, format="json",
                  HTTP_IDEMPOTENCY_KEY="k-2")
    assert resp.status_code == 422
    assert resp.json()["error"] == "unprocessable"
    assert Task.objects.count() == 1


def test_no_key_creates_a_new_task_each_time(requester, device):
    c = client_for(requester)
    a = c.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()
    b = c.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()
    assert a["id"] != b["id"]


@pytest.mark.parametrize(
    ("payload", "status"),
    [({"symptom": "x"}, 400), ({"device_id": "abc", "symptom": "x"}, 400), ({"device_id": 999999, "symptom": "x"}, 404),
     ({"device_id": None, "symptom": ""}, 400)],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(requester, device, payload, status):
    resp = client_for(requester).post("/api/tasks/", payload, format="json")
    assert resp.status_code == status
    assert Task.objects.count() == 0


def test_unauthenticated_requests_are_refused(device):
    assert APIClient().post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").status_code in (401, 403)


def test_other_tenant_cannot_see_or_touch_a_task(requester, device, other_tenant_user):
    task_id = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()["id"]
    outsider = client_for(other_tenant_user)
    assert outsider.get(f"/api/tasks/{task_id}/").status_code == 404
    assert outsider.post(f"/api/tasks/{task_id}/cancel/", {}, format="json").status_code == 404
    assert outsider.get(f"/api/tasks/{task_id}/events/").status_code == 404
    assert outsider.get("/api/tasks/").json() == []
    # Another tenant's device id is "not found", not usable.
    assert outsider.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").status_code == 404


def test_requester_cannot_decide_or_list_approvals(requester, approver, device, kb):
    task_id = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()["id"]
    drive(task_id)
    approval = ApprovalRequest.objects.get(task_id=task_id)
    c = client_for(requester)
    assert c.get("/api/approvals/").status_code == 403
    resp = c.post(f"/api/approvals/{approval.pk}/decision/", {"decision": "approve"}, format="json")
    assert resp.status_code == 403


def test_second_decision_gets_409_with_the_current_decision(requester, approver, admin_user, device, kb):
    task_id = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()["id"]
    drive(task_id)
    approval = ApprovalRequest.objects.get(task_id=task_id)
    first = client_for(approver).post(f"/api/approvals/{approval.pk}/decision/", {"decision": "approve"},
                                      format="json")
    second = client_for(admin_user).post(f"/api/approvals/{approval.pk}/decision/",
                                         {"decision": "reject", "reason": "no"}, format="json")
    assert first.status_code == 200 and first.json()["status"] == "APPROVED"
    assert second.status_code == 409
    assert second.json()["status"] == "APPROVED" and second.json()["decided_by"] == "avery"


def test_reject_needs_a_reason(requester, approver, device, kb):
    task_id = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()["id"]
    drive(task_id)
    approval = ApprovalRequest.objects.get(task_id=task_id)
    resp = client_for(approver).post(f"/api/approvals/{approval.pk}/decision/", {"decision": "reject"}, format="json")
    assert resp.status_code == 422
    approval.refresh_from_db()
    assert approval.status == "PENDING"


@pytest.mark.django_db(transaction=True)
def test_concurrent_decisions_exactly_one_wins(tenant, requester, approver, admin_user, device, kb):
    task_id = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()["id"]
    drive(task_id)
    approval = ApprovalRequest.objects.get(task_id=task_id)
    results = []
    barrier = threading.Barrier(6)

    def decide(user, decision):
        barrier.wait()
        try:
            resp = client_for(user).post(f"/api/approvals/{approval.pk}/decision/",
                                         {"decision": decision, "reason": "race"}, format="json")
            results.append(resp.status_code)
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(u, d)) for u, d in
               [(approver, "approve"), (approver, "approve"), (admin_user, "reject"), (admin_user, "approve"),
                (approver, "reject"), (admin_user, "reject")]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [200, 409, 409, 409, 409, 409]
    task = Task.objects.get(pk=task_id)
    decided = [e for e in task.events.values_list("type", flat=True) if e in ("approval.granted", "approval.rejected")]
    assert len(decided) == 1


def test_openapi_schema_is_served(requester):
    resp = client_for(requester).get("/api/schema/")
    assert resp.status_code == 200
    body = resp.content.decode()
    assert "/api/tasks/" in body and "/api/approvals/{approval_id}/decision/" in body
    assert "Idempotency-Key" in body


def test_unknown_filter_values_are_a_clear_400(approver):
    c = client_for(approver)
    assert c.get("/api/approvals/", {"status": "bogus"}).status_code == 400
    assert c.get("/api/tasks/", {"status": "bogus"}).status_code == 400
    assert c.get("/api/tasks/", {"status": "WAITING_APPROVAL"}).status_code == 200


def test_schema_lists_the_status_values_the_api_returns(requester):
    body = client_for(requester).get("/api/schema/").content.decode()
    assert "WAITING_APPROVAL" in body and "Waiting Approval" not in body


def test_a_nul_character_in_a_header_is_a_clear_400(requester, device):
    """Review F8: nothing reaches the database with a NUL in it."""
    resp = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json",
                                      HTTP_IDEMPOTENCY_KEY="key\x00one")
    assert resp.status_code == 400 and resp.json()["error"] == "invalid_input"
    assert Task.objects.count() == 0


def test_admins_learn_an_actions_idempotency_key_from_the_actions_api_not_a_redacted_payload(
        requester, approver, admin_user, device, kb, refservice, other_tenant_user):
    """Given a completed task whose ticket was created, when an admin reads
    ``/api/tasks/<id>/actions/``, then the action carries the idempotency key, digest, status,
    receipt and attempts it was sent with, while the events API still shows ``intent.committed``
    as a digest only; other roles get 403 and another tenant 404."""
    from apps.actions.models import Action

    task_id = client_for(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()["id"]
    drive(task_id)
    approval = ApprovalRequest.objects.get(task_id=task_id)
    client_for(approver).post(f"/api/approvals/{approval.pk}/decision/", {"decision": "approve"}, format="json")
    task = drive(task_id)
    assert task.status == "COMPLETED"
    action = Action.objects.get(task_id=task_id)

    resp = client_for(admin_user).get(f"/api/tasks/{task_id}/actions/")
    assert resp.status_code == 200
    [shown] = resp.json()
    assert shown["id"] == str(action.pk) and shown["tool"] == "ticket.create"
    assert shown["idempotency_key"] == action.idempotency_key and shown["params_digest"] == action.params_digest
    assert shown["status"] == "SUCCEEDED" and shown["connector"] == "reference"
    assert shown["external_id"] == task.state["receipt"]["external_id"] == shown["receipt"]["external_id"]
    assert shown["approval_id"] == str(approval.pk) and shown["compensates_id"] is None
    assert [a["outcome"] for a in shown["attempts"]] == ["RECEIPT"]
    assert "params" not in shown  # the parameters stay behind the payload view

    events = client_for(admin_user).get(f"/api/tasks/{task_id}/events/").json()
    [intent] = [e for e in events if e["type"] == "intent.committed"]
    assert intent["payload"]["sensitive"] is True and "idempotency_key" not in intent["payload"]

    assert client_for(requester).get(f"/api/tasks/{task_id}/actions/").status_code == 403
    assert client_for(approver).get(f"/api/tasks/{task_id}/actions/").status_code == 403
    assert client_for(other_tenant_user).get(f"/api/tasks/{task_id}/actions/").status_code == 404


def test_the_openapi_schema_generates_without_warnings_and_lists_the_actions_api(tmp_path):
    """drf-spectacular's own validation passes with warnings as errors (e.g. two ``status`` enums
    colliding), and the schema carries the task actions endpoint with the action's status enum."""
    from django.core.management import call_command

    out = tmp_path / "schema.yml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    text = out.read_text()
    assert "/api/tasks/{task_id}/actions/:" in text and "ActionStatusEnum:" in text and "TaskStatusEnum:" in text
