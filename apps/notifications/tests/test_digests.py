"""The approvers' digest: five approvals waiting make one e-mail listing five; the next one waits
for the window; what no longer waits is not mailed; a digest never lists another tenant's task."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from apps.accounts.models import Role
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.notifications.digests import digests_build
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.services import notifications_drain
from apps.notifications.tests.conftest import add_member
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.factories import DeviceFactory, TenantFactory

pytestmark = pytest.mark.django_db

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _waiting(requester, tenant, tag: str):
    device = DeviceFactory(tenant=tenant, asset_tag=tag)
    task = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task.pk)
    assert task.status == reducer.WAITING_APPROVAL, task.termination_reason
    return task


def _digests_to(address: str) -> list:
    return [m for m in mail.outbox if m.to == [address]]


def test_five_approvals_waiting_make_one_email_listing_five(mailed, tenant, kb, refservice):
    tags = [f"PRN-20{i}" for i in range(5)]
    for tag in tags:
        _waiting(mailed["riley"], tenant, tag)
    assert Notification.objects.filter(recipient=mailed["adele"], status=DeliveryStatus.HELD).count() == 5
    notifications_drain()
    [digest_mail] = _digests_to("adele@acme.test")
    assert digest_mail.subject == "[faultdesk] 5 approvals wait for you"
    for tag in tags:
        assert f"- {tag}: create a ticket\n  http://127.0.0.1:8000/approvals/?device={tag}" in digest_mail.body
    digest = Notification.objects.get(recipient=mailed["adele"], kind=NotificationKind.APPROVAL_DIGEST)
    assert digest.status == DeliveryStatus.SENT and not digest.on_page and digest.task_id is None
    assert [i["asset_tag"] for i in digest.context["items"]] == tags
    items = Notification.objects.filter(recipient=mailed["adele"], kind=NotificationKind.APPROVAL_WAITING)
    assert {(i.status, i.digest_id) for i in items} == {(DeliveryStatus.DIGESTED, digest.pk)}
    assert len(_digests_to("avery@acme.test")) == 1  # each approver gets their own one
    assert _digests_to("riley@acme.test") == []  # never the requester


def test_the_next_item_waits_for_the_window_then_goes_out_alone(mailed, tenant, kb, refservice, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "NOTIFY_DIGEST_SECONDS": 300}
    _waiting(mailed["riley"], tenant, "PRN-301")
    notifications_drain()  # the first of a quiet period: at once
    assert len(_digests_to("adele@acme.test")) == 1
    _waiting(mailed["riley"], tenant, "PRN-302")
    _waiting(mailed["riley"], tenant, "PRN-303")
    notifications_drain()
    assert len(_digests_to("adele@acme.test")) == 1  # within the window: held
    assert Notification.objects.filter(recipient=mailed["adele"], status=DeliveryStatus.HELD).count() == 2
    Notification.objects.filter(kind=NotificationKind.APPROVAL_DIGEST).update(
        created_at=timezone.now() - timedelta(seconds=301))
    notifications_drain()
    first, second = _digests_to("adele@acme.test")
    assert second.subject == "[faultdesk] 2 approvals wait for you"
    assert "PRN-302" in second.body and "PRN-303" in second.body and "PRN-301" not in second.body


def test_what_no_longer_waits_is_not_mailed(mailed, tenant, kb, refservice):
    decided = _waiting(mailed["riley"], tenant, "PRN-401")
    _waiting(mailed["riley"], tenant, "PRN-402")
    approval = ApprovalRequest.objects.get(task=decided, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(mailed["avery"]), approval_id=approval.pk, decision="reject", reason="not now")
    notifications_drain()
    [digest_mail] = _digests_to("adele@acme.test")
    assert digest_mail.subject == "[faultdesk] 1 approval waits for you"
    assert "PRN-402" in digest_mail.body and "PRN-401" not in digest_mail.body
    gone = Notification.objects.get(recipient=mailed["adele"], task=decided)
    assert gone.status == DeliveryStatus.SKIPPED and gone.on_page and "no longer waiting" in gone.last_error


def test_a_digest_never_lists_another_tenants_task(mailed, tenant, kb, refservice):
    from apps.accounts.models import AccessScope
    from apps.evidence.services import document_ingest
    from tests.conftest import KB, SMALL_KB
    from tests.factories import MembershipFactory

    globex = TenantFactory(slug="globex", name="Globex")
    for scope, name in SMALL_KB:
        document_ingest(tenant=globex, source=f"{scope}/{name}", raw=(KB / scope / name).read_text(), scope=scope)
    gina = add_member(globex, "gina", Role.REQUESTER, "gina@globex.test")
    gabe = add_member(globex, "gabe", Role.APPROVER, "gabe@globex.test")
    # adele is also globex's approver: she gets one digest per tenant, each of its own tasks
    MembershipFactory(user=mailed["adele"], tenant=globex, role=Role.APPROVER, scopes=list(AccessScope.values))
    _waiting(mailed["riley"], tenant, "PRN-501")
    _waiting(gina, globex, "GLX-0001")
    assert not Notification.objects.filter(recipient__in=[mailed["riley"], mailed["avery"]], tenant=globex).exists()
    assert not Notification.objects.filter(recipient=gabe, tenant=tenant).exists()
    assert digests_build() == 4  # avery@acme, adele@acme, adele@globex, gabe@globex
    notifications_drain()
    [to_gabe] = _digests_to("gabe@globex.test")
    assert "GLX-0001" in to_gabe.body and "PRN-501" not in to_gabe.body
    [to_avery] = _digests_to("avery@acme.test")
    assert "PRN-501" in to_avery.body and "GLX-0001" not in to_avery.body
    to_adele = _digests_to("adele@acme.test")
    assert sorted("GLX-0001" in m.body for m in to_adele) == [False, True]
    assert all(("GLX-0001" in m.body) != ("PRN-501" in m.body) for m in to_adele)
    for digest in Notification.objects.filter(kind=NotificationKind.APPROVAL_DIGEST):
        listed = [i["task_id"] for i in digest.context["items"]]
        assert set(Task.objects.filter(pk__in=listed).values_list("tenant_id", flat=True)) == {digest.tenant_id}
        assert set(digest.items.values_list("tenant_id", flat=True)) == {digest.tenant_id}


def test_an_approver_whose_role_changed_gets_no_digest_of_what_they_can_no_longer_decide(mailed, tenant, kb,
                                                                                          refservice):
    from apps.accounts.models import Membership

    _waiting(mailed["riley"], tenant, "PRN-301")
    Membership.objects.filter(user=mailed["avery"], tenant=tenant).update(role=Role.REQUESTER)
    notifications_drain()
    assert _digests_to("avery@acme.test") == []
    assert len(_digests_to("adele@acme.test")) == 1
    item = Notification.objects.get(recipient=mailed["avery"], kind=NotificationKind.APPROVAL_WAITING)
    assert item.status == DeliveryStatus.SKIPPED and "no longer waiting for this recipient" in item.last_error
