"""The sender's claim, lease and fencing token, backoff and the classification of SMTP errors."""

from __future__ import annotations

import random
import smtplib
import uuid
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.projections import message_id_for
from apps.notifications.sending import backoff_seconds, claim_due, failure_of, send_claimed

pytestmark = pytest.mark.django_db


@pytest.fixture
def row(requester, tenant):
    requester.email = "riley@acme.test"
    requester.save(update_fields=["email"])
    n = Notification(tenant=tenant, recipient=requester, kind=NotificationKind.TICKET_CREATED,
                     context={"ticket": "REF-000042", "asset_tag": "PRN-0417"}, status=DeliveryStatus.PENDING,
                     next_attempt_at=timezone.now())
    n.message_id = message_id_for(n.pk)
    n.save(force_insert=True)
    return n


def test_a_claim_leases_the_row_and_bumps_its_fencing_token(row, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "NOTIFY_LEASE_SECONDS": 30}
    [claimed] = claim_due(owner="a", limit=10)
    assert (claimed.status, claimed.lease_owner, claimed.lease_generation, claimed.attempts) == \
        (DeliveryStatus.SENDING, "a", 1, 1)
    assert claim_due(owner="b", limit=10) == []  # leased: nobody else takes it
    later = timezone.now() + timedelta(seconds=31)
    [taken] = claim_due(owner="b", limit=10, now=later)  # the lease expired: a sender that died
    assert (taken.lease_owner, taken.lease_generation, taken.attempts) == ("b", 2, 2)
    # the first sender wakes up past its lease (its clock says so): it does not send
    claimed.lease_expires_at = timezone.now() - timedelta(seconds=1)
    assert send_claimed([claimed]) == {"lease_expired": 1}
    assert mail.outbox == []


def test_a_mark_with_an_old_token_changes_nothing(row):
    [first] = claim_due(owner="a", limit=10)
    Notification.objects.filter(pk=row.pk).update(lease_generation=2, lease_owner="b")  # taken over meanwhile
    assert send_claimed([first]) == {}  # sent (a resend of the same message), but not marked by this sender
    assert mail.outbox[0].extra_headers["Message-ID"] == row.message_id
    row.refresh_from_db()
    assert (row.status, row.lease_owner) == (DeliveryStatus.SENDING, "b")


def test_backoff_doubles_with_equal_jitter_up_to_the_cap(settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "NOTIFY_RETRY_BASE_SECONDS": 30.0, "NOTIFY_RETRY_CAP_SECONDS": 100.0}
    rng = random.Random(7)
    assert 15 <= backoff_seconds(1, rng=rng) <= 30
    assert 30 <= backoff_seconds(2, rng=rng) <= 60
    assert 50 <= backoff_seconds(5, rng=rng) <= 100


@pytest.mark.parametrize("exc,permanent", [
    (smtplib.SMTPRecipientsRefused({"a@b": (550, b"no such user")}), True),
    (smtplib.SMTPRecipientsRefused({"a@b": (450, b"mailbox busy")}), False),
    (smtplib.SMTPDataError(554, b"rejected"), True),
    (smtplib.SMTPSenderRefused(451, b"try later", "f@x"), False),
    (smtplib.SMTPServerDisconnected("gone"), False),
    (ConnectionRefusedError(111, "refused"), False),
    (TimeoutError("timed out"), False),
])
def test_only_a_5xx_refusal_is_permanent(exc, permanent):
    assert failure_of(exc).permanent is permanent


def test_a_message_that_cannot_be_built_fails_at_once(row):
    row.recipient.email = "riley@acme.test\nBcc: someone@else.test"  # no address is ever two headers
    row.recipient.save(update_fields=["email"])
    assert send_claimed(claim_due(owner="a", limit=10)) == {DeliveryStatus.FAILED: 1}
    row.refresh_from_db()
    assert row.status == DeliveryStatus.FAILED and "cannot build the e-mail" in row.last_error
    assert mail.outbox == []


def test_an_event_that_notifies_the_requester_costs_two_statements(requester, tenant, device,
                                                                   django_assert_num_queries):
    from types import SimpleNamespace

    from apps.notifications.projections import notifications_from_event
    from apps.tasks.services import task_submit
    from tests.conftest import p

    task = task_submit(principal=p(requester), device_id=device.pk, symptom="broken").task
    before = SimpleNamespace(pk=task.pk, tenant_id=tenant.pk, requester_id=requester.pk, status="VALIDATING",
                             state={"status": "VALIDATING", "receipt": None})
    after = {"status": "WAITING_INPUT", "questions": ["since when?"], "request": {"asset_tag": "PRN-0417"}}
    with django_assert_num_queries(2):  # the requester's membership and address, one INSERT
        notifications_from_event(before, SimpleNamespace(id=uuid.uuid4(), seq=5), after)


def test_a_subject_from_a_device_with_a_line_break_is_sent_on_one_line(requester, approver, tenant, kb, refservice):
    """Nothing a person typed into a device's fields can add a header, and the e-mail still goes."""
    from django.core import mail

    from apps.notifications.models import DeliveryStatus, Notification
    from apps.notifications.services import notifications_drain
    from apps.tasks.services import task_submit
    from tests.conftest import drive, p
    from tests.factories import DeviceFactory

    requester.email = "riley@acme.test"
    requester.save(update_fields=["email"])
    device = DeviceFactory(tenant=tenant, asset_tag="PRN-9\r\nBcc: evil@evil.test")
    drive(task_submit(principal=p(requester), device_id=device.pk, urgency="low",
                      symptom="Toner low").task.pk)
    notifications_drain()
    sent = [m for m in mail.outbox if m.to == ["riley@acme.test"]]
    assert sent and all("\n" not in m.subject and "\r" not in m.subject for m in sent)
    assert all(m.bcc == [] and "evil" not in str(m.message()["Bcc"] or "") for m in sent)
    assert not Notification.objects.filter(recipient=requester, status=DeliveryStatus.FAILED).exists()
