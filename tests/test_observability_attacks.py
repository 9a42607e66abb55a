"""Adversarial tests of what faultdesk shows about itself: traces, metrics, logs, tracing and the
requester's pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from apps.actions.models import Action, ActionAttempt
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_submit
from apps.tasks.store import task_append_event
from config.logs import clear
from tests.conftest import drive, p
from tests.factories import DeviceFactory
from tests.tamper import immutability_bypassed

ROOT = Path(__file__).resolve().parents[1]
SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _complete(requester, approver, device, symptom=SYMPTOM):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=symptom, urgency="high").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    return task


@pytest.fixture
def completed(requester, approver, device, kb, refservice):
    return _complete(requester, approver, device)


# --- 1. trace: sensitive payloads, export, odd tasks -------------------------------------------------

def test_export_does_not_inline_sensitive_payloads(client, completed, admin_user):
    """The page shows sensitive payloads as digests; the JSON export prints them whole."""
    client.force_login(admin_user)
    body = client.get(f"/tasks/{completed.pk}/trace.json").content.decode()
    doc = json.loads(body)
    retrieved = TaskEvent.objects.get(task=completed, type="evidence.retrieved")
    excerpt = retrieved.payload["refs"][0]["excerpt"][:60]
    leaked = [e["type"] for e in doc["events"]
              if e["type"] in ("task.accepted", "evidence.retrieved", "model.called", "draft.proposed")
              and e.get("payload")]
    assert SYMPTOM not in body and excerpt not in body, f"sensitive payloads inline in the export: {leaked}"


def test_api_events_do_not_inline_sensitive_payloads(client, completed, admin_user):
    client.force_login(admin_user)
    resp = client.get(f"/api/tasks/{completed.pk}/events/")
    assert resp.status_code == 200
    assert SYMPTOM not in resp.content.decode(), "the API prints the request text the trace hides"


def test_export_lists_webhooks_as_its_docstring_says(client, completed, admin_user):
    client.force_login(admin_user)
    doc = json.loads(client.get(f"/tasks/{completed.pk}/trace.json").content)
    assert "webhooks" in doc["actions"][0], "docstring: 'actions with their attempts and webhooks'"


def test_trace_and_export_of_a_task_with_only_its_first_event(client, admin_user, requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task
    client.force_login(admin_user)
    assert client.get(f"/tasks/{task.pk}/trace/").status_code == 200
    assert client.get(f"/tasks/{task.pk}/trace.json").status_code == 200
    assert client.get(f"/tasks/{task.pk}/events/1/").status_code == 200


@pytest.mark.allow_divergence
def test_trace_of_a_task_whose_reducer_this_build_does_not_carry(client, completed, admin_user):
    Task.objects.filter(pk=completed.pk).update(artifact_bundle={**completed.artifact_bundle, "reducer": "reducer/99"})
    client.force_login(admin_user)
    resp = client.get(f"/tasks/{completed.pk}/trace/")
    assert resp.status_code == 200 and "no data" in resp.content.decode()
    assert client.get(f"/tasks/{completed.pk}/trace.json").status_code == 200
    assert client.get("/ops/metrics/").status_code == 200
    Task.objects.filter(pk=completed.pk).update(artifact_bundle={})
    assert client.get(f"/tasks/{completed.pk}/trace/").status_code == 200
    assert client.get("/ops/metrics/").status_code == 200


def test_event_view_with_an_enormous_seq_is_a_404(client, completed, admin_user):
    client.force_login(admin_user)
    assert client.get(f"/tasks/{completed.pk}/events/99999999999999999999/").status_code == 404
    assert client.get(f"/tasks/{completed.pk}/events/0/").status_code == 404


def test_other_tenants_admin_gets_404_on_every_trace_url(client, completed, other_tenant_user):
    client.force_login(other_tenant_user)
    for url in (f"/tasks/{completed.pk}/trace/", f"/tasks/{completed.pk}/trace.json",
                f"/tasks/{completed.pk}/events/1/", f"/api/tasks/{completed.pk}/events/"):
        assert client.get(url).status_code in (403, 404), url
    assert SYMPTOM not in client.get("/admin-tasks/").content.decode()


def test_budget_line_chart_with_odd_data():
    from apps.traces.charts import bar_chart, line_chart

    assert "<svg" in line_chart([(1, 0, 0)], total=0, title="t")
    assert "<svg" in line_chart([(0, 5, 9)], total=3, title="<script>")
    assert "<script>" not in line_chart([(0, 5, 9)], total=3, title="<script>")
    assert "<svg" in bar_chart([("x", 0, 0)], title="t")


def test_trace_query_count_does_not_grow_with_actions_and_attempts(client, admin_user, requester, approver,
                                                                   device, kb, refservice, tenant):
    one = _complete(requester, approver, device)
    client.force_login(admin_user)

    def count(url):
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(url).status_code == 200
        return len(ctx.captured_queries)

    base = count(f"/tasks/{one.pk}/trace/")
    base_json = count(f"/tasks/{one.pk}/trace.json")
    # give the same task three more actions with two attempts each
    src = Action.objects.get(task=one)
    for i in range(3):
        a = Action.objects.create(tenant_id=src.tenant_id, task_id=src.task_id, tool=src.tool,
                                  tool_version=src.tool_version, connector=src.connector, params=src.params,
                                  params_digest=src.params_digest, idempotency_key=f"{src.idempotency_key}-x{i}",
                                  reservation=src.reservation, status="FAILED",
                                  object_version=src.object_version)
        for n in (1, 2):
            ActionAttempt.objects.create(action=a, number=n, fencing_token=n, started_at=src.created_at,
                                         worker="w", outcome="FAILED")
    assert count(f"/tasks/{one.pk}/trace/") == base
    assert count(f"/tasks/{one.pk}/trace.json") == base_json
    Action.objects.filter(task=one).exclude(pk=src.pk).delete()


def test_metrics_page_query_count_does_not_grow_with_tasks(client, admin_user, requester, device):
    client.force_login(admin_user)
    task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM)

    def count():
        with CaptureQueriesContext(connection) as ctx:
            assert client.get("/ops/metrics/").status_code == 200
        return len(ctx.captured_queries)

    base = count()
    for i in range(15):
        d = DeviceFactory(tenant=device.tenant)
        t = task_submit(principal=p(requester), device_id=d.pk, symptom=f"{SYMPTOM} {i}").task
        if i % 2:
            task_append_event(task=t, event_type="task.failed", payload={"reason": "x"}, actor="test")
    assert count() == base
    with CaptureQueriesContext(connection) as ctx:
        assert client.get("/admin-tasks/").status_code == 200
    assert len(ctx.captured_queries) < 15


# --- 3. /metrics -----------------------------------------------------------------------------------

def _series(client):
    resp = client.get("/metrics")
    assert resp.status_code == 200
    text = resp.content.decode()
    seen, dups = set(), []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key = line.rsplit(" ", 1)[0]
            if key in seen:
                dups.append(key)
            seen.add(key)
    list(text_string_to_metric_families(text))
    return text, dups


@pytest.mark.allow_divergence
def test_metrics_has_no_duplicate_series_when_two_tools_fall_into_other(client, requester, approver, device, kb,
                                                                        refservice):
    a = _complete(requester, approver, device)
    b = _complete(requester, approver, DeviceFactory(tenant=device.tenant))
    with immutability_bypassed("actions_action"):  # actions of tools since retired from the registry
        Action.objects.filter(task=a).update(tool="ticket.retired_one")
        Action.objects.filter(task=b).update(tool="ticket.retired_two")
    text, dups = _series(client)
    assert not dups, f"duplicate series (Prometheus rejects the scrape): {dups}"


def test_metrics_token_with_non_ascii_authorization_is_401_not_500(client, settings, db):
    settings.FAULTDESK = {**settings.FAULTDESK, "METRICS_TOKEN": "scrape-secret"}
    client.raise_request_exception = False
    resp = client.get("/metrics", HTTP_AUTHORIZATION="Bearer sécret")
    assert resp.status_code == 401, resp.status_code


def test_metrics_labels_carry_no_identifiers(client, completed):
    text, _ = _series(client)
    for ident in (str(completed.pk), "acme", "riley", "PRN-0417", str(completed.tenant_id) + '"'):
        assert ident not in text


# --- 6. htmx: fragment / full page / Vary -----------------------------------------------------------

@pytest.mark.parametrize("url", ["/ops/metrics/", "/admin-tasks/", "/reconciliation/", "TRACE"])
def test_admin_pages_vary_on_hx_request(client, completed, admin_user, url):
    url = f"/tasks/{completed.pk}/trace/" if url == "TRACE" else url
    client.force_login(admin_user)
    resp = client.get(url)
    assert "HX-Request" in resp.get("Vary", ""), f"{url}: Vary={resp.get('Vary')!r}"


@pytest.mark.parametrize("url", ["/ops/metrics/", "/reconciliation/", "TRACE"])
def test_admin_pages_answer_an_htmx_request_with_a_fragment(client, completed, admin_user, url):
    url = f"/tasks/{completed.pk}/trace/" if url == "TRACE" else url
    client.force_login(admin_user)
    body = client.get(url, HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in body, f"{url}: full page for an htmx request"


def test_request_page_full_fragment_and_history_restore(client, requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task
    client.force_login(requester)
    full = client.get(f"/tasks/{task.pk}/")
    frag = client.get(f"/tasks/{task.pk}/", HTTP_HX_REQUEST="true")
    restore = client.get(f"/tasks/{task.pk}/", HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")
    assert "<html" in full.content.decode() and "<html" in restore.content.decode()
    assert "<html" not in frag.content.decode() and 'id="task-status"' in frag.content.decode()
    for r in (full, frag, restore):
        assert "HX-Request" in r["Vary"]


# --- 5. the requester's page ------------------------------------------------------------------------

def test_now_line_of_a_failed_request_does_not_say_done(client, requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task
    task_append_event(task=task, event_type="task.failed", payload={"reason": "model unavailable"}, actor="test")
    client.force_login(requester)
    body = client.get(f"/tasks/{task.pk}/").content.decode()
    assert "<strong>Now:</strong> Done." not in body, "a FAILED request reads 'Now: Done.'"


def test_now_line_per_status(requester, device, kb):
    from apps.tasks.selectors import task_now

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom="broken").task.pk)
    assert task.status == reducer.WAITING_INPUT
    assert "Waiting for your answer" in task_now(task)
    for s in reducer.ALL_STATUSES:
        t = Task(status=s, state={})
        assert task_now(t) != s, f"no words for {s}"


# --- 4. logs ----------------------------------------------------------------------------------------



def test_dispatch_log_lines_do_not_carry_the_previous_rows_attempt(json_lines, requester, approver, device, kb,
                                                                   refservice):
    """Two rows in one dispatcher batch: the second (cancelled, never sent) must not log with the
    first row's attempt number."""
    from apps.agent.runner import agent_run
    from apps.outbox.dispatch import outbox_dispatch_batch

    tasks = []
    for dev in (device, DeviceFactory(tenant=device.tenant)):
        t = drive(task_submit(principal=p(requester), device_id=dev.pk, symptom=SYMPTOM, urgency="high").task.pk)
        approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(
            task=t, status=ApprovalStatus.PENDING).pk, decision="approve", reason="ok")
        agent_run(task_id=t.pk)
        tasks.append(Task.objects.get(pk=t.pk))
    task_cancel(principal=p(requester), task_id=tasks[1].pk, reason="fixed")
    json_lines()  # discard
    clear()
    outbox_dispatch_batch()
    lines = json_lines()
    second = str(Action.objects.get(task=tasks[1]).pk)
    assert not ActionAttempt.objects.filter(action_id=second).exists()
    mine = [line for line in lines if line.get("action_id") == second]
    assert mine, "the second row logs something"
    assert all("attempt" not in line for line in mine), [(m["event"], m.get("attempt")) for m in mine]
    drive(tasks[0].pk)
    drive(tasks[1].pk)


def test_login_logs_no_password_and_no_session_cookie(json_lines, client, requester):
    requester.set_password("Sup3r-Secret-PW")
    requester.save()
    client.post("/login/", {"username": "riley", "password": "wrong-Secret-PW"})
    client.post("/login/", {"username": "riley", "password": "Sup3r-Secret-PW"})
    client.get("/requests/", HTTP_X_REQUEST_ID="abc")
    client.get("/does-not-exist/")
    raw = json.dumps(json_lines())
    session = client.cookies["sessionid"].value
    assert "Secret-PW" not in raw and session not in raw


def test_x_request_id_injection_is_replaced(client, requester):
    client.force_login(requester)
    for bad in ("a" * 65, "x\ny", "<script>", "a b", "é"):
        rid = client.get("/requests/", HTTP_X_REQUEST_ID=bad)["X-Request-ID"]
        assert rid != bad and len(rid) == 32
    assert client.get("/requests/", HTTP_X_REQUEST_ID="a" * 64)["X-Request-ID"] == "a" * 64


def test_nul_byte_rejection_still_carries_a_request_id(client, requester):
    resp = client.get("/requests/?q=a%00b", HTTP_X_REQUEST_ID="rid-1")
    assert resp.status_code == 400
    assert resp.get("X-Request-ID") == "rid-1", "the 400 from RejectNulBytesMiddleware has no request id"


def _py(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    e.update(DJANGO_SETTINGS_MODULE="config.settings.local", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=120)


def test_celery_worker_logging_stays_json():
    """A Celery worker sets up its logging after Django: unless hijacking is off, it replaces the
    root handler (and its structlog formatter) with its own plain-text one."""
    r = _py("""
        import logging, django
        django.setup()
        from config.celery import app
        app.log.setup_logging_subsystem(loglevel="INFO")
        logging.getLogger("celery.apps.worker").info("celery@host ready.")
    """)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if "ready." in line]
    assert lines, r.stderr[-2000:]
    for line in lines:
        json.loads(line)


def test_tracing_off_by_default_loads_no_instrumentation():
    r = _py("""
        import sys, config.wsgi, config.tracing
        print("DONE", config.tracing._DONE)
        print("LOADED", sorted(m for m in sys.modules if m.startswith("opentelemetry.instrumentation")))
    """)
    assert "DONE False" in r.stdout and "LOADED []" in r.stdout, r.stdout + r.stderr[-2000:]


def test_tracing_endpoint_from_dotenv_turns_tracing_on_in_the_web_process():
    """README: everything is read from the environment or .env. The web calls setup_tracing before
    the settings (and so .env) are read."""
    dotenv = ROOT / ".env"
    if dotenv.exists():
        pytest.skip("this checkout has a developer .env; the test writes its own")
    dotenv.write_text("OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:9/\n")
    try:
        r = _py("""
            import config.wsgi, config.tracing, os
            print("ENV", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
            print("DONE", config.tracing._DONE)
        """)
    finally:
        dotenv.unlink()
    assert "ENV http://127.0.0.1:9/" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "DONE True" in r.stdout, r.stdout


def test_tracing_with_an_endpoint_exports_over_otlp():
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, the web process exports a span for a request."""
    r = _py("""
        import threading, http.server
        got = []
        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                got.append((self.path, len(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(200); self.end_headers()
            def log_message(self, *a): pass
        srv = http.server.HTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        import os
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{srv.server_port}"
        import config.wsgi
        from django.test import Client
        assert Client().get("/login/").status_code == 200  # a page that needs no database
        from opentelemetry import trace
        trace.get_tracer_provider().force_flush()
        print("GOT", got)
    """)
    assert "GOT [('/v1/traces'" in r.stdout, r.stdout + r.stderr[-3000:]
