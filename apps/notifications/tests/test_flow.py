"""Notifications along the main job, in-process (the agent, tools and outbox driven step by step):
who is told what, rows written with their event and only with it, once per event, and sent once
through Django's e-mail backend (the test's in-memory outbox here; a real SMTP server in
test_smtp.py)."""

from __future__ import annotations

import pytest
from django.core import mail
from django.db import transaction

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.projections import notifications_from_event
from apps.notifications.services import notifications_drain
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_submit
from apps.tasks.store import task_append_event
from tests.conftest import drive, p

pytestmark = pytest.mark.django_db

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _kinds(user) -> list[tuple[str, str]]:
    return sorted(Notification.objects.filter(recipient=user).values_list("kind", "status"))


def _waiting(mailed, device):
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, urgency="high",
                             symptom=SYMPTOM).task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    return task


def test_an_approval_waiting_is_held_for_each_approver_never_the_requester(mailed, device, kb, refservice):
    task = _waiting(mailed, device)
    assert _kinds(mailed["avery"]) == [(NotificationKind.APPROVAL_WAITING, DeliveryStatus.HELD)]
    assert _kinds(mailed["adele"]) == [(NotificationKind.APPROVAL_WAITING, DeliveryStatus.HELD)]
    assert _kinds(mailed["riley"]) == []
    item = Notification.objects.get(recipient=mailed["avery"])
    approval = ApprovalRequest.objects.get(task=task)
    assert item.task_id == task.pk and item.tenant_id == task.tenant_id
    assert item.context["approval_id"] == str(approval.pk) and item.context["tool"] == "ticket.create"
    assert item.context["asset_tag"] == "PRN-0417"
    event = TaskEvent.objects.get(task=task, type="approval.requested")
    assert (item.source_event_id, item.source_event_seq) == (event.id, event.seq)
    assert item.message_id == f"<notify.{item.pk.hex}@faultdesk.localhost>"


def test_the_requester_learns_the_ticket_id_and_the_end_once_each(mailed, device, kb, refservice):
    task = _waiting(mailed, device)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(mailed["avery"]), approval_id=approval.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    ticket = task.state["receipt"]["external_id"]
    assert _kinds(mailed["riley"]) == [(NotificationKind.TASK_ENDED, DeliveryStatus.PENDING),
                                       (NotificationKind.TICKET_CREATED, DeliveryStatus.PENDING)]
    created = Notification.objects.get(recipient=mailed["riley"], kind=NotificationKind.TICKET_CREATED)
    assert created.context == {"ticket": ticket, "asset_tag": "PRN-0417"}
    ended = Notification.objects.get(recipient=mailed["riley"], kind=NotificationKind.TASK_ENDED)
    assert ended.context["status"] == "COMPLETED" and ended.context["ticket"] == ticket
    assert ended.context["reason"].startswith("ticket_created")

    notifications_drain()
    to_riley = [m for m in mail.outbox if m.to == ["riley@acme.test"]]
    assert sorted(m.subject for m in to_riley) == sorted([
        f"[faultdesk] Ticket {ticket} created for PRN-0417",
        "[faultdesk] Your request about PRN-0417 is completed"])
    for m in to_riley:
        n = Notification.objects.get(message_id=m.extra_headers["Message-ID"])
        assert m.extra_headers["X-Faultdesk-Notification"] == str(n.pk)
        assert m.extra_headers["References"] == f"<task.{task.pk.hex}@faultdesk.localhost>"
        assert n.status == DeliveryStatus.SENT and n.attempts == 1 and n.email_to == "riley@acme.test"
    assert f"/tasks/{task.pk}/" in to_riley[0].body
    # a second drain sends nothing again
    outbox = len(mail.outbox)
    notifications_drain()
    assert len(mail.outbox) == outbox


def test_a_question_tells_the_requester_with_the_questions(mailed, device, kb):
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, symptom="broken").task.pk)
    assert task.status == reducer.WAITING_INPUT
    [n] = Notification.objects.filter(recipient=mailed["riley"])
    assert n.kind == NotificationKind.INPUT_REQUESTED and n.context["questions"] == task.state["questions"]
    notifications_drain()
    [m] = mail.outbox
    assert m.subject == "[faultdesk] Question about your report on PRN-0417"
    assert task.state["questions"][0] in m.body


def test_a_cancel_tells_the_requester_once_with_the_reason(mailed, device, kb):
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, symptom="broken").task.pk)
    task_cancel(principal=p(mailed["riley"]), task_id=task.pk, reason="fixed itself")
    ended = Notification.objects.get(recipient=mailed["riley"], kind=NotificationKind.TASK_ENDED)
    assert ended.context["status"] == "CANCELLED" and ended.context["reason"] == "cancelled: fixed itself"
    notifications_drain()
    [m] = [m for m in mail.outbox if "cancelled" in m.subject]
    assert m.subject == "[faultdesk] Your request about PRN-0417 was cancelled"
    assert "Reason: cancelled: fixed itself" in m.body


def test_a_rolled_back_event_notifies_nobody(mailed, device, kb, refservice):
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, symptom="broken").task.pk)
    before = Notification.objects.count()
    task = Task.objects.get(pk=task.pk)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        task_append_event(task=task, event_type="task.failed", payload={"reason": "model_error: gone"}, actor="test")
        assert Notification.objects.filter(kind=NotificationKind.TASK_ENDED).count() == 1  # written with it...
        raise Boom
    assert Notification.objects.count() == before  # ...and rolled back with it
    assert Task.objects.get(pk=task.pk).status == reducer.WAITING_INPUT


def test_the_projection_run_again_for_the_same_event_adds_nothing(mailed, device, kb):
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, symptom="broken").task.pk)
    event = TaskEvent.objects.get(task=task, type="input.requested")
    before_task = Task.objects.get(pk=task.pk)
    before_task.status, before_task.state = reducer.VALIDATING, {**task.state, "status": reducer.VALIDATING}
    notifications_from_event(before_task, event, task.state)
    notifications_from_event(before_task, event, task.state)
    assert Notification.objects.filter(kind=NotificationKind.INPUT_REQUESTED).count() == 1


def test_a_deactivated_requester_gets_nothing_and_one_without_address_the_page_only(mailed, device, kb, tenant):
    from apps.notifications.tests.conftest import Role, add_member

    mailed["riley"].email = ""
    mailed["riley"].save(update_fields=["email"])
    task = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, symptom="broken").task.pk)
    [n] = Notification.objects.filter(recipient=mailed["riley"])
    assert n.status == DeliveryStatus.SKIPPED and n.on_page  # shown on the page, never mailed
    notifications_drain()
    assert mail.outbox == []

    gone = add_member(tenant, "dora", Role.REQUESTER, "dora@acme.test")
    task = drive(task_submit(principal=p(gone), device_id=device.pk, symptom="broken").task.pk)
    Notification.objects.filter(recipient=gone).delete()
    gone.is_active = False
    gone.save(update_fields=["is_active"])
    task_cancel(principal=p(mailed["adele"]), task_id=task.pk, reason="left the company")
    assert not Notification.objects.filter(recipient=gone).exists()


def test_a_deactivation_after_the_row_was_written_stops_the_mail(mailed, device, kb):
    drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, symptom="broken").task.pk)
    mailed["riley"].is_active = False
    mailed["riley"].save(update_fields=["is_active"])
    notifications_drain()
    assert mail.outbox == []
    n = Notification.objects.get(recipient=mailed["riley"])
    assert n.status == DeliveryStatus.SKIPPED and "no longer an active member" in n.last_error


def _approve(approver, task) -> None:
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")


def test_a_report_that_joins_an_open_ticket_says_which_ticket(mailed, device, kb, refservice):
    first = _waiting(mailed, device)
    _approve(mailed["avery"], first)
    first = drive(first.pk)
    ticket = first.state["receipt"]["external_id"]
    second = drive(task_submit(principal=p(mailed["riley"]), device_id=device.pk, urgency="high",
                               symptom="Paper jams at the fuser exit on every duplex job from tray 2.").task.pk)
    item = Notification.objects.get(recipient=mailed["adele"], task=second)
    assert item.context["tool"] == "ticket.comment" and item.context["ticket"] == ticket
    notifications_drain()
    digest = next(m for m in mail.outbox if m.to == ["adele@acme.test"] and "approval" in m.subject)
    assert f"PRN-0417: add a comment to ticket {ticket}" in digest.body
    _approve(mailed["avery"], second)
    second = drive(second.pk)
    assert second.state["receipt"]["kind"] == "comment"
    joined = Notification.objects.get(task=second, kind=NotificationKind.REPORT_JOINED)
    assert joined.recipient == mailed["riley"]
    assert joined.context == {"ticket": ticket, "comment": second.state["receipt"]["external_id"],
                              "asset_tag": "PRN-0417"}
    assert not Notification.objects.filter(task=second, kind=NotificationKind.TICKET_CREATED).exists()
    notifications_drain()
    [m] = [m for m in mail.outbox if "added to ticket" in m.subject]
    assert m.subject == f"[faultdesk] Your report on PRN-0417 was added to ticket {ticket}"
    assert f"comment {second.state['receipt']['external_id']}" in m.body


def test_a_ticket_made_after_the_cancel_is_told_and_its_closing_asked_of_the_approvers(mailed, device, kb,
                                                                                        refservice, refadmin):
    from apps.agent.runner import agent_run
    from tests.conftest import created_then_cancelled

    task = _waiting(mailed, device)
    _approve(mailed["avery"], task)
    agent_run(task_id=task.pk)
    task = created_then_cancelled(task.pk, canceller=mailed["riley"], refadmin=refadmin)
    assert task.status == reducer.COMPENSATING
    ticket = task.state["receipt"]["external_id"]
    kinds = [k for k, _ in _kinds(mailed["riley"])]
    assert sorted(kinds) == [NotificationKind.TASK_ENDED, NotificationKind.TICKET_CREATED]
    closing = Notification.objects.get(recipient=mailed["adele"], task=task, context__compensation=True)
    assert closing.context["ticket"] == ticket and closing.status == DeliveryStatus.HELD
    _approve(mailed["avery"], task)
    task = drive(task.pk)
    assert task.status == reducer.CANCELLED and task.state["compensation"]["status"] == "DONE"
    # the compensation's end puts the task back to CANCELLED: the requester learns what became of the
    # ticket (closed), in a notification of its own, and the closing no longer calls from the bell
    ended = Notification.objects.filter(task=task, kind=NotificationKind.TASK_ENDED).order_by("created_at")
    assert [n.context.get("after_cancel", False) for n in ended] == [False, True]
    assert ended[1].context["ticket"] == ticket and "compensation done" in ended[1].context["reason"]
    assert not Notification.objects.filter(task=task, kind=NotificationKind.APPROVAL_WAITING,
                                           read_at__isnull=True).exists()


def test_a_decided_or_cancelled_approval_no_longer_calls_from_the_bell(mailed, tenant, kb, refservice):
    from apps.approvals.models import ApprovalRequest, ApprovalStatus
    from apps.notifications.models import Notification, NotificationKind
    from apps.tasks.services import task_cancel, task_submit
    from tests.conftest import drive, p
    from tests.factories import DeviceFactory

    symptom = "Fuser error after warm-up, pages come out smeared with unfused toner."
    first = drive(task_submit(principal=p(mailed["riley"]), device_id=DeviceFactory(tenant=tenant).pk,
                              urgency="high", symptom=symptom).task.pk)
    second = drive(task_submit(principal=p(mailed["riley"]), device_id=DeviceFactory(tenant=tenant).pk,
                               urgency="high", symptom=symptom).task.pk)
    waiting = Notification.objects.filter(kind=NotificationKind.APPROVAL_WAITING)
    assert waiting.filter(read_at__isnull=True).count() == 2 * waiting.values("recipient").distinct().count()
    from apps.approvals.services import approval_decide

    approval_decide(principal=p(mailed["avery"]), decision="reject", reason="not ours",
                    approval_id=ApprovalRequest.objects.get(task_id=first.pk, status=ApprovalStatus.PENDING).pk)
    task_cancel(principal=p(mailed["riley"]), task_id=second.pk, reason="fixed itself")
    assert not waiting.filter(read_at__isnull=True).exists()
