"""Notifications through a real SMTP server on loopback (aiosmtpd): the exact messages it
receives — envelope recipient, subject with the ticket id, the recipient's language, the stable
Message-ID — and the delivery states after temporary and permanent SMTP refusals."""

from __future__ import annotations

import re

import pytest
from django.utils import timezone, translation
from django.utils.translation import ngettext

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.services import notifications_drain
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p

pytestmark = pytest.mark.django_db

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
CJK = re.compile(r"[\u4e00-\u9fff]")


def _body(message, subtype: str) -> str:
    return message.get_body(preferencelist=(subtype,)).get_content()


def test_the_smtp_server_receives_exactly_the_messages_due(smtp, mailed, device, kb, refservice):
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, urgency="high",
                             symptom=SYMPTOM).task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    notifications_drain()
    # The approvers: one digest each (the first item of a quiet period goes out at once).
    assert sorted(r for rcpt, _ in smtp.messages for r in rcpt) == ["adele@acme.test", "avery@acme.test"]
    [adele] = smtp.to("adele@acme.test")
    assert adele["Subject"] == "[faultdesk] 1 approval waits for you"
    assert "PRN-0417: create a ticket" in _body(adele, "plain")
    assert "http://127.0.0.1:8000/approvals/?device=PRN-0417" in _body(adele, "plain")
    # avery saved Chinese: the same digest in Chinese
    [avery] = smtp.to("avery@acme.test")
    with translation.override("zh-hans"):
        expected = "[faultdesk] " + ngettext("%(count)d approval waits for you", "%(count)d approvals wait for you",
                                             1) % {"count": 1}
    assert avery["Subject"] == expected and CJK.search(expected)
    assert avery["Content-Language"] == "zh-hans"
    assert '<html lang="zh-hans">' in _body(avery, "html")

    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(mailed["avery"]), approval_id=approval.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    ticket = task.state["receipt"]["external_id"]
    smtp.messages.clear()
    notifications_drain()
    to_riley = smtp.to("riley@acme.test")
    assert len(smtp.messages) == len(to_riley) == 2
    assert sorted(m["Subject"] for m in to_riley) == sorted([
        f"[faultdesk] Ticket {ticket} created for PRN-0417", "[faultdesk] Your request about PRN-0417 is completed"])
    for m in to_riley:
        n = Notification.objects.get(pk=m["X-Faultdesk-Notification"])
        assert m["Message-ID"] == n.message_id == f"<notify.{n.pk.hex}@faultdesk.localhost>"
        assert m["To"] == "riley@acme.test" and m["From"] == "faultdesk <faultdesk@localhost>"
        assert m["Auto-Submitted"] == "auto-generated" and m["Content-Language"] == "en"
        assert m.get_content_type() == "multipart/alternative"
        assert f"http://127.0.0.1:8000/tasks/{task.pk}/" in _body(m, "plain")
        assert f'href="http://127.0.0.1:8000/tasks/{task.pk}/"' in _body(m, "html")
        assert n.status == DeliveryStatus.SENT and n.sent_at is not None and n.attempts == 1
    created = next(m for m in to_riley if "created" in m["Subject"])
    assert f"Ticket {ticket} was created for your report on PRN-0417" in _body(created, "plain")


def _pending(user, **context) -> Notification:
    from apps.notifications.projections import message_id_for

    n = Notification(tenant_id=user.memberships.get().tenant_id, recipient=user, kind=NotificationKind.TICKET_CREATED,
                     context={"ticket": "REF-000042", "asset_tag": "PRN-0417", **context},
                     status=DeliveryStatus.PENDING, next_attempt_at=timezone.now())
    n.message_id = message_id_for(n.pk)
    n.save(force_insert=True)
    return n


def test_a_temporary_refusal_is_retried_with_backoff_then_sent(smtp, mailed, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "NOTIFY_RETRY_BASE_SECONDS": 60.0}
    n = _pending(mailed["riley"])
    smtp.refuse("451 4.3.0 try again later")
    assert notifications_drain()[DeliveryStatus.PENDING] == 1
    n.refresh_from_db()
    assert n.status == DeliveryStatus.PENDING and n.attempts == 1 and "451" in n.last_error
    wait = (n.next_attempt_at - timezone.now()).total_seconds()
    assert 25 <= wait <= 61  # 60 s with equal jitter: between half and all of it
    notifications_drain()
    assert smtp.messages == []  # not due yet
    Notification.objects.filter(pk=n.pk).update(next_attempt_at=timezone.now())
    notifications_drain()
    [(rcpt, m)] = smtp.messages
    n.refresh_from_db()
    assert n.status == DeliveryStatus.SENT and n.attempts == 2 and m["Message-ID"] == n.message_id


def test_a_permanent_refusal_fails_at_once_and_the_last_attempt_gives_up(smtp, mailed, settings):
    permanent = _pending(mailed["riley"])
    smtp.refuse("550 5.1.1 no such mailbox")
    notifications_drain()
    permanent.refresh_from_db()
    assert permanent.status == DeliveryStatus.FAILED and permanent.attempts == 1 and "550" in permanent.last_error

    settings.FAULTDESK = {**settings.FAULTDESK, "NOTIFY_MAX_ATTEMPTS": 2, "NOTIFY_RETRY_BASE_SECONDS": 0.0}
    flaky = _pending(mailed["riley"])
    smtp.refuse("421 4.7.0 busy", times=2)
    notifications_drain()  # attempt 1: back to PENDING, due at once (base 0)
    notifications_drain()  # attempt 2, the last
    flaky.refresh_from_db()
    assert flaky.status == DeliveryStatus.FAILED and flaky.attempts == 2 and "421" in flaky.last_error
    assert smtp.messages == []


def test_a_server_that_is_down_leaves_the_row_pending(mailed, settings):
    from apps.notifications.tests.conftest import free_port

    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", free_port(), 2
    n = _pending(mailed["riley"])
    notifications_drain()
    n.refresh_from_db()
    assert n.status == DeliveryStatus.PENDING and n.attempts == 1 and "ConnectionRefusedError" in n.last_error
