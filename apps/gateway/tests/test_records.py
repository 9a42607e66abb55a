"""The record of outbound calls (ADR 0022): written outside the caller's transaction, cheap, carrying
the tenant and task the caller has bound, read-only and tenant-scoped in the Django admin, and purged
by the retention run."""

from __future__ import annotations

import statistics
import time
import uuid
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from apps.gateway.destinations import Destination, destination_of
from apps.gateway.http import http_request
from apps.gateway.models import GatewayCall
from apps.gateway.records import call_record
from apps.gateway.tests.servers import Recorder
from config.logs import bind, bound, clear
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db

DEST = Destination("http", "records.test", 4242)


def _record(**kwargs):
    call_record(**{"tool": "ticket.reference", "destination": DEST, "method": "GET", "path": "/tickets?key=secret",
                   "outcome": "ok", "at": timezone.now(), "duration_ms": 3, "http_status": 200, **kwargs})


def test_a_rolled_back_caller_still_leaves_its_calls_recorded(settings):
    server = Recorder()
    try:
        settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_URL": server.url}
        with pytest.raises(RuntimeError), transaction.atomic():
            http_request("ticket.reference", "GET", f"{server.url}/tickets?idempotency_key=k", timeout=5)
            raise RuntimeError("the caller rolls back")
    finally:
        server.close()
    row = GatewayCall.objects.get(port=server.server_address[1])
    assert (row.outcome, row.path, row.method) == ("ok", "/tickets", "GET"), "the query string is never kept"


def test_the_tenant_and_task_bound_to_the_callers_context_are_recorded(tenant):
    task_id = uuid.uuid4()
    bind(tenant_id=tenant.pk, task_id=task_id)
    try:
        _record(path="/bound")
    finally:
        clear()
    _record(path="/unbound")
    bound, unbound = GatewayCall.objects.get(path="/bound"), GatewayCall.objects.filter(path="/unbound").last()
    assert (bound.tenant_id, bound.task_id) == (tenant.pk, task_id)
    assert (unbound.tenant_id, unbound.task_id) == (None, None)


def test_a_record_is_one_cheap_insert():
    """The insert on the gateway's own connection, measured: it sits on every outbound call."""
    _record(path="/warm-up")
    took = []
    for _ in range(300):
        started = time.perf_counter()
        _record(path="/timed")
        took.append(time.perf_counter() - started)
    mean_ms, p95_ms = statistics.mean(took) * 1000, sorted(took)[int(len(took) * 0.95)] * 1000
    print(f"gateway call record: mean {mean_ms:.3f} ms, p95 {p95_ms:.3f} ms over {len(took)} inserts")
    assert mean_ms < 5.0, (mean_ms, p95_ms)


def test_a_record_that_cannot_be_written_never_fails_the_call(monkeypatch, caplog):
    from apps.gateway import records

    def broken():
        raise RuntimeError("database down")

    monkeypatch.setattr(records, "_pause_until", 0.0)  # put back as it was after the test
    monkeypatch.setattr(records, "_connection", broken)
    _record(path="/lost")
    assert "outbound call not recorded" in caplog.text
    monkeypatch.setattr(records, "_connection", lambda: pytest.fail("no reconnect at every call while it fails"))
    _record(path="/lost-too")  # paused: nothing tried
    monkeypatch.undo()


def test_the_admin_shows_calls_read_only_and_only_of_the_admins_tenant(client, admin_user, tenant, other_tenant_user):
    from apps.accounts.models import Membership

    other_tenant = Membership.objects.filter(user=other_tenant_user).first().tenant
    bind(tenant_id=tenant.pk)
    _record(path="/of-my-tenant")
    bind(tenant_id=other_tenant.pk)
    _record(path="/of-another-tenant")
    clear()
    _record(path="/of-no-tenant")
    client.force_login(admin_user)
    page = client.get("/django-admin/gateway/gatewaycall/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "/of-my-tenant" in text and "/of-another-tenant" not in text and "/of-no-tenant" not in text
    assert client.get("/django-admin/gateway/gatewaycall/add/").status_code == 403
    mine = GatewayCall.objects.get(path="/of-my-tenant")
    change = client.post(f"/django-admin/gateway/gatewaycall/{mine.pk}/change/", {"outcome": "timeout"})
    assert change.status_code in (302, 403) and GatewayCall.objects.get(pk=mine.pk).outcome == "ok"


def test_the_retention_run_purges_old_calls_and_keeps_recent_ones(tenant):
    from apps.retention.purge import purge_run

    bind(tenant_id=tenant.pk)
    _record(path="/old", at=timezone.now() - timedelta(days=40))
    _record(path="/recent", at=timezone.now() - timedelta(days=2))
    clear()
    _record(path="/old-no-tenant", at=timezone.now() - timedelta(days=40))
    run = purge_run()
    assert run.tables["gateway_gatewaycall"]["rows"] >= 2
    assert not GatewayCall.objects.filter(path__in=["/old", "/old-no-tenant"]).exists()
    assert GatewayCall.objects.filter(path="/recent").exists()


def test_destinations_are_scheme_host_and_port():
    assert destination_of("https://Model.Example/v1") == Destination("https", "model.example", 443)
    assert destination_of("http://[::1]:8080/x") == Destination("http", "::1", 8080)
    assert destination_of("smtp://relay:25") == Destination("smtp", "relay", 25)
    for bad in ("/relative", "ftp://x", "http://h:99999"):
        with pytest.raises(ValueError):
            destination_of(bad)


def test_ids_bound_for_a_block_are_recorded_in_it_and_the_earlier_ones_come_back_after(tenant):
    other = TenantFactory(slug="globex")
    outer_task, inner_task = uuid.uuid4(), uuid.uuid4()
    bind(tenant_id=other.pk, task_id=outer_task)
    try:
        with bound(tenant_id=tenant.pk, task_id=inner_task):
            _record(path="/inner")
        _record(path="/outer")
    finally:
        clear()
    inner, outer = GatewayCall.objects.get(path="/inner"), GatewayCall.objects.get(path="/outer")
    assert (inner.tenant_id, inner.task_id) == (tenant.pk, inner_task)
    assert (outer.tenant_id, outer.task_id) == (other.pk, outer_task)
