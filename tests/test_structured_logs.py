"""Structured JSON logs: every line is one JSON object, and the lines of the main job carry the
tenant, task, action, attempt and event ids bound by the web, the agent and the dispatcher
(``config.logs``)."""

from __future__ import annotations

import logging
import logging.config

from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.tasks.services import task_submit
from tests.conftest import drive, p


def test_the_main_jobs_lines_carry_tenant_task_action_attempt_and_event_ids(json_lines, requester, approver, device,
                                                                           kb, refservice):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                             symptom="Fuser error after warm-up, pages come out smeared.").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    lines = json_lines()
    missing = [line for line in lines if not {"event", "level", "logger", "timestamp"} <= set(line)]
    assert lines and not missing, missing[:3]
    appended = [line for line in lines if line["event"] == "event.appended"]
    assert [line["event_seq"] for line in appended] == list(range(1, task.version + 1))
    assert {(line["task_id"], line["tenant_id"]) for line in appended} == {(str(task.pk), str(task.tenant_id))}
    assert appended[-1]["event_type"] == "task.completed" and appended[-1]["status"] == "COMPLETED"
    action_id = str(task.state["action"]["id"])
    sent = [line for line in lines if line.get("action_id") == action_id and line["logger"] == "httpx"]
    assert sent and {(line.get("attempt"), line.get("step")) for line in sent} == {("1", "dispatch")}, sent
    assert any("POST" in line["event"] and "/tickets" in line["event"] for line in sent)


def test_a_web_request_binds_a_request_id_and_the_tenant(json_lines, client, requester, device):
    client.force_login(requester)
    resp = client.get("/requests/", HTTP_X_REQUEST_ID="req-abc.123")
    assert resp["X-Request-ID"] == "req-abc.123"
    assert client.get("/requests/", HTTP_X_REQUEST_ID="bad id with spaces")["X-Request-ID"] != "bad id with spaces"
    logging.getLogger("apps.test").info("inside")  # after the request: the context was cleared
    assert "request_id" not in json_lines()[-1]
