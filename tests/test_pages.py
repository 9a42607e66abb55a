"""Server-rendered pages (DESIGN.md §1): login, the requester's form and live status page (full
page vs HTMX fragment, ``Vary: HX-Request``), the approver's queue with HTMX decisions, the
admin's trace, and the Django admin for every model."""

from __future__ import annotations

import pytest
from django.apps import apps as django_apps
from django.contrib import admin
from django.urls import reverse

from apps.approvals.models import ApprovalRequest
from apps.tasks.models import Task
from tests.conftest import drive


@pytest.fixture
def filed(client, requester, device, kb):
    client.force_login(requester)
    resp = client.post(reverse("request-new"), {"device": device.pk, "symptom": "Fuser error after warm-up.",
                                                "urgency": "high"})
    task = Task.objects.get()
    assert resp.status_code == 302 and resp["Location"] == reverse("task-detail", args=[task.pk])
    return task


def test_login_page_and_redirect_for_anonymous(client):
    assert client.get(reverse("login")).status_code == 200
    resp = client.get(reverse("request-new"))
    assert resp.status_code == 302 and reverse("login") in resp["Location"]


def test_home_sends_each_role_to_its_page(client, requester, approver, admin_user):
    for user, name in [(requester, "request-list"), (approver, "approval-queue"), (admin_user, "admin-tasks")]:
        client.force_login(user)
        assert client.get(reverse("home"))["Location"] == reverse(name)


def test_invalid_form_shows_errors_and_creates_nothing(client, requester, device):
    client.force_login(requester)
    resp = client.post(reverse("request-new"), {"device": device.pk, "symptom": "", "urgency": "high"})
    assert resp.status_code == 422
    assert Task.objects.count() == 0


def test_status_page_full_and_fragment(client, filed):
    url = reverse("task-detail", args=[filed.pk])
    full = client.get(url)
    assert full.status_code == 200
    assert b"<html" in full.content and b'hx-trigger="every 2s"' in full.content
    assert "HX-Request" in full["Vary"]
    fragment = client.get(url, HTTP_HX_REQUEST="true")
    assert b"<html" not in fragment.content and b'id="task-status"' in fragment.content
    assert "HX-Request" in fragment["Vary"]
    restore = client.get(url, HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true")
    assert b"<html" in restore.content


def test_status_page_stops_polling_when_terminal_and_shows_three_results(client, filed, approver, refservice):
    drive(filed.pk)
    approval = ApprovalRequest.objects.get(task=filed)
    client.force_login(approver)
    resp = client.post(reverse("approval-decide", args=[approval.pk]), {"decision": "approve", "reason": "ok"},
                       HTTP_HX_REQUEST="true")
    assert resp.status_code == 200 and b"APPROVED" in resp.content and b"<html" not in resp.content
    task = drive(filed.pk)
    assert task.status == "COMPLETED"
    client.force_login(task.requester)
    page = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "every 2s" not in page
    assert "Citations" in page and "Proposal" in page and "Confirmed change" in page
    assert task.state["receipt"]["external_id"] in page


def test_queue_lists_pending_with_parameters_and_version(client, filed, approver):
    drive(filed.pk)
    client.force_login(approver)
    page = client.get(reverse("approval-queue")).content.decode()
    approval = ApprovalRequest.objects.get(task=filed)
    assert approval.params["title"] in page
    assert "at version 17" in page
    assert f'hx-post="{reverse("approval-decide", args=[approval.pk])}"' in page


def test_second_htmx_decision_shows_409_row(client, filed, approver, admin_user):
    drive(filed.pk)
    approval = ApprovalRequest.objects.get(task=filed)
    client.force_login(approver)
    client.post(reverse("approval-decide", args=[approval.pk]), {"decision": "approve"}, HTTP_HX_REQUEST="true")
    client.force_login(admin_user)
    resp = client.post(reverse("approval-decide", args=[approval.pk]), {"decision": "reject", "reason": "x"},
                       HTTP_HX_REQUEST="true")
    assert resp.status_code == 409 and b"already approved" in resp.content


def test_trace_is_for_admins_only(client, filed, requester, admin_user, other_tenant_user):
    drive(filed.pk)
    url = reverse("task-trace", args=[filed.pk])
    client.force_login(requester)
    assert client.get(url).status_code == 404
    client.force_login(other_tenant_user)
    assert client.get(url).status_code == 404
    client.force_login(admin_user)
    page = client.get(url).content.decode()
    for etype in ("task.accepted", "evidence.retrieved", "device.read", "draft.proposed", "approval.requested"):
        assert etype in page


def test_django_admin_has_every_model(client, admin_user, filed):
    ours = [m for m in django_apps.get_models() if m.__module__.startswith("apps.")]
    assert ours
    client.force_login(admin_user)
    for model in ours:
        assert model in admin.site._registry, f"{model.__name__} is not in the Django admin"
        url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
        assert client.get(url).status_code == 200, url


def test_htmx_is_told_to_swap_refusals_into_the_row(client, approver):
    client.force_login(approver)
    page = client.get(reverse("approval-queue")).content.decode()
    assert '"code":"4..","swap":true' in page


def test_only_requesters_and_admins_get_the_request_form(client, approver, admin_user):
    client.force_login(approver)
    assert client.get(reverse("request-new")).status_code == 403
    client.force_login(admin_user)
    assert client.get(reverse("request-new")).status_code == 200


def test_django_admin_is_tenant_scoped_and_event_sourced_rows_are_read_only(
    client, filed, admin_user, other_tenant_user, device
):
    from apps.devices.models import Device
    from tests.factories import DeviceFactory

    foreign = DeviceFactory(tenant=other_tenant_user.memberships.get().tenant, asset_tag="GX-1")
    client.force_login(admin_user)
    listing = client.get(reverse("admin:devices_device_changelist")).content.decode()
    assert device.asset_tag in listing and "GX-1" not in listing
    assert client.get(reverse("admin:devices_device_change", args=[foreign.pk])).status_code == 302  # not found
    task_url = reverse("admin:tasks_task_change", args=[filed.pk])
    assert client.get(task_url).status_code == 200  # view only
    assert client.post(task_url, {"budget_total": 5}).status_code == 403
    # A device edit goes through the service: the object version moves by one.
    data = {"name": device.name, "kind": device.kind, "model": device.model, "site": device.site,
            "criticality": device.criticality, "state": "ok", "alert_code": "", "alert_message": "",
            "metrics": "{}"}
    resp = client.post(reverse("admin:devices_device_change", args=[device.pk]), data)
    assert resp.status_code == 302, resp.content.decode()[:2000]
    assert Device.objects.get(pk=device.pk).version == device.version + 1


def test_django_admin_forms_offer_nothing_of_another_tenant(client, admin_user, other_tenant_user, tenant):
    """Review finding: an acme admin could create a membership in globex through the add form."""
    from apps.accounts.models import Membership

    globex = other_tenant_user.memberships.get().tenant
    client.force_login(admin_user)
    import re

    def options(page: str, field: str) -> set[str]:
        select = re.search(rf'<select name="{field}".*?</select>', page, re.S).group(0)
        return set(re.findall(r'<option value="(\d+)"', select))

    form = client.get(reverse("admin:accounts_membership_add")).content.decode()
    assert options(form, "tenant") == {str(tenant.pk)}
    assert str(other_tenant_user.pk) not in options(form, "user") and other_tenant_user.username not in form
    resp = client.post(reverse("admin:accounts_membership_add"),
                       {"user": admin_user.pk, "tenant": globex.pk, "role": "admin", "scopes": '["public"]',
                        "is_active": "on"})
    assert resp.status_code == 200 and "Select a valid choice" in resp.content.decode()
    assert not Membership.objects.filter(user=admin_user, tenant=globex).exists()
    for name in ("admin:devices_device_add", "admin:approvals_approvalpolicy_add"):
        assert options(client.get(reverse(name)).content.decode(), "tenant") == {str(tenant.pk)}
    assert client.get(reverse("admin:accounts_tenant_add")).status_code == 403
