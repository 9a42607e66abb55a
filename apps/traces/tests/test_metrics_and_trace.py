"""Metrics and the trace: ``/metrics`` is valid Prometheus text with task and dispatch counters; the
trace and metrics pages cost the same number of queries for a task with 10 events as for one with
2,000; the trace exports as JSON and charts the budget."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from apps.tasks.store import task_append_event
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.fixture
def completed(requester, approver, device, kb, refservice):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    return task


def _task_with_events(requester, device, n: int) -> Task:
    """A running task with exactly ``n`` events: accepted, retrieval started, then reservations and
    their settlements (a real, replayable log)."""
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=f"{n} events").task
    task = task_append_event(task=task, event_type="retrieval.started", payload={}, actor="test")
    while task.version < n:
        rid = str(uuid.uuid4())
        task = task_append_event(task=task, event_type="budget.reserved", actor="test", payload={
            "reservation_id": rid, "activity": "probe", "amounts": {"tool_calls": 0, "money": 0}})
        if task.version < n:
            task = task_append_event(task=task, event_type="budget.settled", actor="test",
                                     payload={"reservation_id": rid, "used": {}})
    assert TaskEvent.objects.filter(task=task).count() == n
    return task


def _metrics(client) -> dict:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(resp.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_is_valid_prometheus_text_with_task_and_dispatch_counters(client, completed, requester, device):
    task_submit(principal=p(requester), device_id=device.pk, symptom="A second request, still accepted")
    m = _metrics(client)
    assert m[("faultdesk_tasks", (("status", "COMPLETED"),))] == 1
    assert m[("faultdesk_tasks", (("status", "ACCEPTED"),))] == 1
    assert m[("faultdesk_tasks_accepted_total", ())] == 2
    assert m[("faultdesk_dispatch_attempts_total", (("outcome", "RECEIPT"), ("tool", "ticket.create")))] == 1
    assert m[("faultdesk_actions", (("status", "SUCCEEDED"), ("tool", "ticket.create")))] == 1
    assert m[("faultdesk_outbox_messages", (("status", "DELIVERED"),))] == 1
    assert m[("faultdesk_approvals", (("status", "APPROVED"),))] == 1
    assert m[("faultdesk_model_calls_total", (("outcome", "ok"),))] == 1
    assert m[("faultdesk_cost_units_used_total", ())] == completed.budget_used == 5
    # bounded label sets: every status is a known one, no task or tenant identifiers
    labels = {v for (_, lbl) in m for _, v in lbl}
    assert not any(str(completed.pk) in v or "acme" in v for v in labels)


def test_metrics_requires_the_token_when_one_is_set(client, settings, db):
    settings.FAULTDESK = {**settings.FAULTDESK, "METRICS_TOKEN": "scrape-secret"}
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret").status_code == 200


def _queries(client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        resp = client.get(url)
    assert resp.status_code == 200, resp.content[:500]
    return len(ctx.captured_queries)


def test_trace_and_metrics_pages_cost_the_same_queries_for_10_and_2000_events(client, admin_user, requester,
                                                                              device):
    small = _task_with_events(requester, device, 10)
    client.force_login(admin_user)
    trace_small = _queries(client, f"/tasks/{small.pk}/trace/")
    metrics_small = _queries(client, "/ops/metrics/")
    export_small = _queries(client, f"/tasks/{small.pk}/trace.json")
    chart_small = _queries(client, f"/tasks/{small.pk}/trace/budget/")
    large = _task_with_events(requester, device, 2000)
    # the long trace's first page draws no chart inline (it is fetched as a fragment): one query fewer
    assert _queries(client, f"/tasks/{large.pk}/trace/") == trace_small - 1
    assert _queries(client, f"/tasks/{large.pk}/trace/?page=7") == trace_small  # + the phase before the page
    assert _queries(client, f"/tasks/{large.pk}/trace/budget/") == chart_small
    assert _queries(client, "/ops/metrics/") == metrics_small
    assert _queries(client, f"/tasks/{large.pk}/trace.json") == export_small
    page = client.get(f"/tasks/{large.pk}/trace/").content.decode()
    assert page.count("<code>budget.reserved</code>") == 49 and "<polyline" not in page  # odd seqs 3–99
    assert f'hx-get="/tasks/{large.pk}/trace/budget/"' in page and "page 1 of 20" in page
    assert "<polyline" in client.get(f"/tasks/{large.pk}/trace/budget/").content.decode()


def test_the_trace_exports_as_json_and_only_to_its_tenants_admin(client, completed, admin_user, requester,
                                                                 other_tenant_user):
    client.force_login(admin_user)
    resp = client.get(f"/tasks/{completed.pk}/trace.json")
    assert resp.status_code == 200 and "attachment" in resp["Content-Disposition"]
    doc = json.loads(resp.content)
    assert doc["format"] == "faultdesk-trace/1" and doc["task"]["status"] == reducer.COMPLETED
    assert [e["seq"] for e in doc["events"]] == list(range(1, completed.version + 1))
    assert doc["events"][-1]["type"] == "task.completed"
    [action] = doc["actions"]
    assert action["status"] == "SUCCEEDED" and action["attempts"][0]["outcome"] == "RECEIPT"
    assert doc["task"]["budget"] == {"total": 100, "used": 5, "reserved": 0}
    assert action["webhooks"] == []
    # sensitive payloads are digests with their view, unless asked for
    accepted = doc["events"][0]
    assert accepted["type"] == "task.accepted" and accepted["payload"]["sensitive"] is True
    assert accepted["payload"]["view"] == f"/tasks/{completed.pk}/events/1/" and SYMPTOM not in resp.content.decode()
    full = client.get(f"/tasks/{completed.pk}/trace.json", {"include": "payloads"}).json()
    assert full["events"][0]["payload"]["request"]["symptom"] == SYMPTOM
    for user in (requester, other_tenant_user):
        client.force_login(user)
        assert client.get(f"/tasks/{completed.pk}/trace.json").status_code == 404


def test_the_trace_charts_the_budget_over_the_events(client, completed, admin_user):
    client.force_login(admin_user)
    page = client.get(f"/tasks/{completed.pk}/trace/").content.decode()
    assert 'aria-label="Cost units over the events: used, and used + reserved"' in page
    from apps.traces.views import budget_series

    series = budget_series(completed, list(TaskEvent.objects.filter(task=completed).order_by("seq")))
    assert len(series) == completed.version
    intent = TaskEvent.objects.get(task=completed, type="intent.committed").seq
    receipt = TaskEvent.objects.get(task=completed, type="receipt.recorded").seq
    assert series[intent - 1][1:] == (0, 5) and series[receipt - 1][1:] == (5, 5)


def test_the_metrics_page_shows_the_tenants_figures(client, completed, admin_user, requester, device, approver,
                                                    other_tenant_user):
    failed = task_submit(principal=p(requester), device_id=device.pk, symptom="Will fail").task
    task_append_event(task=failed, event_type="task.failed", payload={"reason": "test"}, actor="test")
    client.force_login(admin_user)
    page = client.get("/ops/metrics/").content.decode()
    assert "2 (0 open, 1 completed, 1 failed, 0 cancelled)" in page
    assert "50 % of ended requests" in page
    assert "approval.granted 1" in page  # avery's decision is a human intervention
    assert "reducer/6" in page and "local-drafter/2" in page
    from apps.traces.metrics import tenant_metrics

    m = tenant_metrics(tenant_id=completed.tenant_id)
    assert m["rates"]["completion"] == 0.5 and m["totals"]["duplicate_actions"] == 0
    assert m["by_version"][0].tasks == 2 and m["by_version"][0].cost_p50 == 2.5
    [today] = m["by_day"]
    assert (today["tasks"], today["completed"], today["failed"], today["completion"]) == (2, 1, 1, 0.5)
    assert today["latency_p95_s"] is not None and today["latency_p95_s"] >= 0
    assert f"<td>{today['day']:%Y-%m-%d}</td><td>2</td><td>1</td><td>1</td><td>0</td>" in page
    # another tenant's admin sees its own (empty) figures, none of acme's
    client.force_login(other_tenant_user)
    other = client.get("/ops/metrics/").content.decode()
    assert "0 (0 open, 0 completed, 0 failed, 0 cancelled)" in other
    # a requester may not open it
    client.force_login(requester)
    assert client.get("/ops/metrics/").status_code == 404


def test_sensitive_payloads_show_as_digests_with_an_access_checked_view(client, completed, admin_user, requester,
                                                                        other_tenant_user):
    client.force_login(admin_user)
    page = client.get(f"/tasks/{completed.pk}/trace/").content.decode()
    retrieved = TaskEvent.objects.get(task=completed, type="evidence.retrieved")
    excerpt = retrieved.payload["refs"][0]["excerpt"][:60]
    assert excerpt not in page, "document text is not printed on the trace"
    assert f"/tasks/{completed.pk}/events/{retrieved.seq}/" in page and retrieved.payload_digest[:15] in page
    assert '"reservation_id"' in page or "reservation_id" in page  # ledger payloads stay inline
    view = client.get(f"/tasks/{completed.pk}/events/{retrieved.seq}/")
    assert view.status_code == 200 and retrieved.payload_digest in view.content.decode()
    assert client.get(f"/tasks/{completed.pk}/events/999/").status_code == 404
    for user in (requester, other_tenant_user):
        client.force_login(user)
        assert client.get(f"/tasks/{completed.pk}/events/{retrieved.seq}/").status_code == 404


def test_the_trace_reads_as_the_causal_chain_of_the_main_job(client, completed, admin_user):
    import re

    client.force_login(admin_user)
    page = client.get(f"/tasks/{completed.pk}/trace/").content.decode()
    phases = re.findall(r'class="phase-start"><td>\d+</td><td><strong>([^<]+)</strong>', page)
    assert phases == ["request", "evidence and device", "model call", "proposal", "approval", "intent", "receipt",
                      "answer"]


@pytest.mark.parametrize("url", ["/ops/metrics/", "/admin-tasks/", "/reconciliation/", "TRACE", "EVENT"])
def test_admin_pages_are_full_pages_or_htmx_fragments_and_vary_on_hx_request(client, completed, admin_user, url):
    url = {"TRACE": f"/tasks/{completed.pk}/trace/", "EVENT": f"/tasks/{completed.pk}/events/1/"}.get(url, url)
    client.force_login(admin_user)
    full = client.get(url)
    fragment = client.get(url, HTTP_HX_REQUEST="true")
    restore = client.get(url, HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")
    for resp in (full, fragment, restore):
        assert resp.status_code == 200 and "HX-Request" in resp["Vary"]
    assert "<html" in full.content.decode() and "<html" in restore.content.decode()
    body = fragment.content.decode()
    assert "<html" not in body and "<h1>" in body


def test_the_pages_of_a_long_trace_show_every_event_once_in_order_with_its_phase(client, admin_user, requester,
                                                                                device):
    import re

    task = _task_with_events(requester, device, 250)
    client.force_login(admin_user)
    seen, starts = [], []
    for number in (1, 2, 3):
        resp = client.get(f"/tasks/{task.pk}/trace/", {"page": number}, HTTP_HX_REQUEST="true",
                          HTTP_HX_TARGET="events")
        body = resp.content.decode()
        assert resp.status_code == 200 and body.startswith('<section id="events">') and "<h1>" not in body
        assert f"page {number} of 3" in body
        seen += [int(s) for s in re.findall(r'<tr(?: class="phase-start")?><td>(\d+)</td>', body)]
        starts += re.findall(r'class="phase-start"><td>(\d+)</td><td><strong>([^<]+)</strong>', body)
    assert seen == list(range(1, 251))
    # the phase carries across page boundaries: "request" starts at 1, "evidence and device" at 2, and
    # the budget rows after them never start a phase of their own, on any page
    assert starts == [("1", "request"), ("2", "evidence and device")]
    # anything that is not a page number is the first page, a number past the end the last
    assert "events 1–100" in client.get(f"/tasks/{task.pk}/trace/", {"page": "x'; DROP"}).content.decode()
    assert "events 201–250" in client.get(f"/tasks/{task.pk}/trace/", {"page": 99}).content.decode()
    # without htmx the pager's links are plain links to full pages
    full = client.get(f"/tasks/{task.pk}/trace/", {"page": 2}).content.decode()
    assert "<h1>" in full and 'href="?page=3"' in full and 'href="?page=1"' in full


def test_the_cost_chart_of_a_trace_is_for_its_tenants_admin_only(client, completed, admin_user, requester,
                                                                 other_tenant_user):
    client.force_login(admin_user)
    full = client.get(f"/tasks/{completed.pk}/trace/budget/")
    fragment = client.get(f"/tasks/{completed.pk}/trace/budget/", HTTP_HX_REQUEST="true")
    assert full.status_code == 200 and "<h1>" in full.content.decode() and "<polyline" in full.content.decode()
    assert fragment.status_code == 200 and "<h1>" not in fragment.content.decode()
    assert 'aria-label="Cost units over the events: used, and used + reserved"' in fragment.content.decode()
    for user in (requester, other_tenant_user):
        client.force_login(user)
        assert client.get(f"/tasks/{completed.pk}/trace/budget/").status_code == 404
