"""End to end with real processes: web (gunicorn), a Celery worker on the ``agent``, ``tools`` and
``outbox`` queues, Celery beat and the reference ticket service, all against the test database and a
real broker (Redis, and RabbitMQ). The test acts only through HTTP."""

from __future__ import annotations

import time

import httpx
import pytest
from django.contrib.auth.hashers import make_password

from apps.accounts.models import AccessScope, Role
from apps.evidence.models import Chunk
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tickets.models import InboundWebhook, TicketMirror
from tests.conftest import KB, SMALL_KB
from tests.factories import DeviceFactory, MembershipFactory, TenantFactory, UserFactory
from tests.procs import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(params=["redis", "amqp"])
def stack(request, transactional_db, tmp_path):
    """Web, one worker on all queues, beat and the reference ticket service; the broker is Redis, then
    RabbitMQ (a virtual host of the test's own: the local server, tools/rabbitmq.py)."""
    s = Stack(tmp_path, broker=request.param)
    try:
        s.start_refservice()
        s.start_web()
        s.start_worker("worker")
        s.start_beat()
        yield s
    finally:
        s.stop_all()


def seed_acme(*, auto_approve: bool = False):
    """Tenant acme with riley (requester) and avery (approver) whose passwords the server processes
    can check (PBKDF2), device PRN-0417 and the small knowledge base."""
    from apps.approvals.models import ApprovalPolicy
    from apps.evidence.services import document_ingest

    tenant = TenantFactory(slug="acme", name="ACME")
    requester = MembershipFactory(user=UserFactory(username="riley"), tenant=tenant, role=Role.REQUESTER,
                                  scopes=[AccessScope.PUBLIC, AccessScope.TIER2]).user
    approver = MembershipFactory(user=UserFactory(username="avery"), tenant=tenant, role=Role.APPROVER,
                                 scopes=list(AccessScope.values)).user
    for user in (requester, approver):
        user.password = make_password("pw-for-tests", hasher="pbkdf2_sha256")
        user.save(update_fields=["password"])
    device = DeviceFactory(tenant=tenant, asset_tag="PRN-0417")
    for scope, name in SMALL_KB:
        document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB / scope / name).read_text(), scope=scope)
    if auto_approve:
        ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
            "ticket.create": {"requires_approval": False, "ttl_minutes": 60}})
    return tenant, requester, device


def poll(client, task_id, statuses, timeout, stack):
    deadline = time.monotonic() + timeout
    body = None
    while time.monotonic() < deadline:
        body = client.get(f"/api/tasks/{task_id}/").raise_for_status().json()
        if body["status"] in statuses:
            return body
        time.sleep(0.3)
    raise AssertionError(f"task stuck in {body and body['status']}\n{stack.logs()}")


def ref_client(stack):
    return httpx.Client(base_url=stack.ref, headers={"Authorization": "Bearer e2e-key"}, timeout=10)


def test_main_job_end_to_end_with_real_processes(stack):
    tenant, requester, device = seed_acme()
    riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
    avery = httpx.Client(base_url=stack.web, auth=("avery", "pw-for-tests"), timeout=30)
    body = {"device_id": device.pk, "symptom": "Fuser error after warm-up; pages smeared.", "urgency": "high"}

    created = riley.post("/api/tasks/", json=body, headers={"Idempotency-Key": "e2e-1"})
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    assert riley.post("/api/tasks/", json=body, headers={"Idempotency-Key": "e2e-1"}).json()["id"] == task_id

    waiting = poll(riley, task_id, {"WAITING_APPROVAL"}, 120, stack)
    assert waiting["receipt"] is None
    approvals = avery.get("/api/approvals/", params={"status": "PENDING", "task": task_id}).json()
    assert len(approvals) == 1
    decided = avery.post(f"/api/approvals/{approvals[0]['id']}/decision/", json={"decision": "approve"})
    assert decided.status_code == 200, decided.text

    done = poll(riley, task_id, {"COMPLETED", "FAILED", "CANCELLED"}, 120, stack)
    assert done["status"] == "COMPLETED"
    ticket_id = done["receipt"]["external_id"]
    assert done["answer"]["change"]["ticket_id"] == ticket_id

    task = Task.objects.get(pk=task_id)
    key = task.state["action"]["idempotency_key"]
    ref = ref_client(stack)
    held = ref.get("/tickets", params={"idempotency_key": key}).json()["results"]
    assert [t["id"] for t in held] == [ticket_id]
    assert ref.get("/_admin/effects", params={"idempotency_key": key}).json()["effects"] == 1
    assert len(ref.get("/_admin/tickets").json()["results"]) == 1

    refs = task.state["evidence"]
    assert refs
    for r in refs:
        chunk = Chunk.objects.select_related("document_version").get(pk=r["chunk_id"])
        assert chunk.scope in ("public", "tier2") and chunk.tenant_id == tenant.pk
        assert chunk.document_version.version == r["version"]

    result = task_replay(task)
    assert result.ok, result.detail
    # the worker took its messages from the broker the stack was given
    scheme = {"redis": "redis+socket://", "amqp": "amqp://"}[stack.broker_kind]
    assert f'"Connected to {scheme}' in stack.log("worker"), stack.log("worker")[-2000:]

    # What `curl /metrics` gets from the web process: valid Prometheus text with the task and
    # dispatch counters of this run.
    from prometheus_client.parser import text_string_to_metric_families

    scraped = httpx.get(f"{stack.web}/metrics", timeout=10)
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped.text) for s in family.samples}
    assert samples[("faultdesk_tasks", (("status", "COMPLETED"),))] == 1
    assert samples[("faultdesk_dispatch_attempts_total", (("outcome", "RECEIPT"), ("tool", "ticket.create")))] == 1

    # A person resolves the ticket in the ticket system: its signed webhook reaches the web
    # process, which verifies it and updates our mirror of the ticket.
    assert ref.patch(f"/tickets/{ticket_id}", json={"status": "resolved"}, headers={"If-Match": '"1"'}).is_success
    deadline = time.monotonic() + 30
    while TicketMirror.objects.get(external_id=ticket_id).status != "resolved":
        assert time.monotonic() < deadline, f"webhook never applied: {stack.log('refservice')[-2000:]}"
        time.sleep(0.2)
    hook = InboundWebhook.objects.get(outcome="APPLIED")
    assert hook.verified and hook.action.task_id == task.pk


def test_main_job_with_the_openai_compatible_provider_in_real_processes(transactional_db, tmp_path):
    """The model provider end to end (DESIGN.md §10; ADR 0013): the main job through web, a Celery
    worker, beat and the reference service, drafting with the OpenAI-compatible provider against
    the scripted model server (its own process), which first answers 503 and then a malformed reply:
    the task still completes, within its budget, with each call recorded."""
    import json
    import sys

    from apps.events.models import TaskEvent
    from tests.procs import free_port

    model_port = free_port()
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"status": 503}, {"content": "{\"title\": \"cut off"}, {"reply": "draft"}]))
    s = Stack(tmp_path, FAULTDESK_MODEL_PROVIDER="openai_compatible",
              FAULTDESK_MODEL_BASE_URL=f"http://127.0.0.1:{model_port}/v1", FAULTDESK_MODEL_API_KEY="e2e-model-key",
              FAULTDESK_RETRY_BACKOFF_BASE_SECONDS="0.05")
    try:
        s.start("model", [sys.executable, "-m", "tools.scripted_model_server", "--port", str(model_port),
                          "--script", str(script), "--api-key", "e2e-model-key"])
        s.start_refservice()
        s.start_web()
        s.start_worker("worker")
        s.start_beat()
        s.wait_http(f"http://127.0.0.1:{model_port}/healthz", 30)
        tenant, requester, device = seed_acme()
        riley = httpx.Client(base_url=s.web, auth=("riley", "pw-for-tests"), timeout=30)
        avery = httpx.Client(base_url=s.web, auth=("avery", "pw-for-tests"), timeout=30)
        created = riley.post("/api/tasks/", json={"device_id": device.pk, "urgency": "high",
                                                  "symptom": "Fuser error after warm-up; pages smeared."})
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        assert created.json()["artifact_bundle"]["model_provider"] == "openai_compatible"
        poll(riley, task_id, {"WAITING_APPROVAL"}, 120, s)
        [approval] = avery.get("/api/approvals/", params={"status": "PENDING", "task": task_id}).json()
        assert avery.post(f"/api/approvals/{approval['id']}/decision/", json={"decision": "approve"}).status_code == 200
        done = poll(riley, task_id, {"COMPLETED", "FAILED", "CANCELLED"}, 120, s)
        assert done["status"] == "COMPLETED", done["termination_reason"]
        assert done["limits"]["retries"]["used"] == 2 and done["limits"]["open_reservations"] == 0
        assert done["budget_reserved"] == 0 and done["budget_used"] <= done["budget_total"]
        task = Task.objects.get(pk=task_id)
        outcomes = list(TaskEvent.objects.filter(task=task, type="model.called").order_by("seq")
                        .values_list("payload__outcome", flat=True))
        assert outcomes == ["unavailable", "malformed", "ok"]
        received = httpx.get(f"http://127.0.0.1:{model_port}/_script/requests",
                             headers={"Authorization": "Bearer e2e-model-key"}).json()
        assert len(received["requests"]) == 3 and received["remaining"] == 0
        assert task_replay(task).ok
    finally:
        s.stop_all()
