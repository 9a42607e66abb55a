"""The approver's queue page (ADR 0012): filters, pagination, what changed since the previous
proposal, the target's version then and now, expired and invalidated approvals visible with their
reason — and a query count that does not grow with the queue (10 vs 1,000 pending approvals)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.devices.services import device_update_state
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.factories import DeviceFactory

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _bulk_pending(tenant, requester, device, n, *, tool="ticket.create", expires_in=timedelta(hours=1)):
    """``n`` tasks waiting for approval, written directly (their rows only: no events)."""
    now = timezone.now()
    tasks = Task.objects.bulk_create([
        Task(tenant=tenant, requester=requester, device=device, symptom=f"report {i}",
             status=reducer.WAITING_APPROVAL, deadline_at=now + timedelta(hours=1), budget_total=100,
             artifact_bundle={}, request_digest="x", state=reducer.initial_state())
        for i in range(n)])
    ApprovalRequest.objects.bulk_create([
        ApprovalRequest(tenant=tenant, task=t, requested_by=requester, tool=tool, tool_version="1",
                        params={"title": f"[{device.asset_tag}] report {i}", "priority": "P3", "description": "d",
                                "labels": []},
                        action_digest=f"{i:064d}", object_type="device", object_id=str(device.pk),
                        object_version=device.version, policy_version=1, scope="acme:ticket.create",
                        side_effects="Creates one ticket.", evidence=[], expires_at=now + expires_in,
                        approver_roles=["approver", "admin"])
        for i, t in enumerate(tasks)])


def _queries(client, url) -> int:
    with CaptureQueriesContext(connection) as ctx:
        resp = client.get(url)
    assert resp.status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.allow_divergence  # the bulk tasks have rows but no events, on purpose
def test_the_queue_costs_the_same_queries_for_10_and_1000_pending(client, tenant, requester, approver, device,
                                                                   django_assert_num_queries):
    client.force_login(approver)
    _bulk_pending(tenant, requester, device, 10)
    small = _queries(client, reverse("approval-queue"))
    _bulk_pending(tenant, requester, device, 990)
    assert ApprovalRequest.objects.filter(status="PENDING").count() == 1000
    with django_assert_num_queries(small):
        assert client.get(reverse("approval-queue")).status_code == 200
    html = client.get(reverse("approval-queue") + "?page=50").content.decode()
    assert "1000 approvals pending" in html and "page 50 of 50" in html


@pytest.mark.allow_divergence
def test_filters_and_pagination(client, tenant, requester, approver, device):
    other = DeviceFactory(tenant=tenant, asset_tag="PRN-9999")
    _bulk_pending(tenant, requester, device, 25)
    _bulk_pending(tenant, requester, other, 3, tool="ticket.comment")
    _bulk_pending(tenant, requester, other, 2, expires_in=timedelta(seconds=-5))
    client.force_login(approver)
    url = reverse("approval-queue")
    first = client.get(url).content.decode()
    assert "28 approvals pending" in first and first.count('class="card approval"') == 20 and "page 1 of 2" in first
    second = client.get(url + "?page=2").content.decode()
    assert second.count('class="card approval"') == 8
    assert client.get(url + "?page=99").content.decode().count('class="card approval"') == 8, "last page"
    tools = client.get(url + "?tool=ticket.comment").content.decode()
    assert "3 approvals pending for ticket.comment" in tools
    devices = client.get(url + "?device=9999").content.decode()
    assert "3 approvals pending on devices matching" in devices
    expired = client.get(url + "?status=EXPIRED").content.decode()
    assert expired.count('class="card approval"') == 2 and "without a decision" in expired
    assert 'name="decision"' not in expired, "an expired approval cannot be decided"
    assert client.get(url + "?status=bogus&tool=nope&page=x").status_code == 200


def test_a_fragment_for_htmx_and_a_full_page_otherwise(client, approver):
    client.force_login(approver)
    full = client.get(reverse("approval-queue"))
    fragment = client.get(reverse("approval-queue"), HTTP_HX_REQUEST="true")
    restore = client.get(reverse("approval-queue"), HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")
    assert "<html" in full.content.decode() and "<html" in restore.content.decode()
    assert "<html" not in fragment.content.decode() and 'id="queue"' in fragment.content.decode()
    assert all("HX-Request" in r["Vary"] for r in (full, fragment, restore))


def test_a_reproposal_shows_what_changed_and_the_version_then_and_now(client, requester, approver, device, kb,
                                                                      refservice):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    first = ApprovalRequest.objects.get(task=task)
    client.force_login(approver)
    device_update_state(device=device, alert_message="Fuser temperature low: 120 C")  # V_o 17 → 18
    html = client.get(reverse("approval-queue")).content.decode()
    assert "at version 17 (now 18 — changed since it was asked)" in html
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    html = client.get(reverse("approval-queue")).content.decode()
    assert "Changed since the previous proposal in this task (invalidated: device version changed" in html
    closed = client.get(reverse("approval-queue") + "?status=INVALIDATED").content.decode()
    assert "Approved by avery — ok; invalidated — device version changed since approval (17 → 18)" in closed
    assert "<td>description</td>" in html and "object version 17" in html and "object version 18" in html
    invalidated = client.get(reverse("approval-queue") + "?status=INVALIDATED").content.decode()
    assert str(first.pk) in invalidated and "device version changed since approval (17 → 18)" in invalidated
    assert ApprovalRequest.objects.get(pk=first.pk).status == ApprovalStatus.INVALIDATED


@pytest.mark.allow_divergence
def test_the_approvals_api_filters_by_task(client, tenant, requester, approver, device):
    """What the demo client and the README read: ``?task=`` answers that task's approvals only."""
    _bulk_pending(tenant, requester, device, 3)
    tasks = list(Task.objects.filter(tenant=tenant).order_by("created_at", "pk"))
    client.force_login(approver)
    for task in tasks:
        rows = client.get("/api/approvals/", {"status": "PENDING", "task": str(task.pk)}).json()
        assert [r["task_id"] for r in rows] == [str(task.pk)]
    assert client.get("/api/approvals/", {"task": "not-a-uuid"}).json() == []
