"""The page channel: the bell (a polled fragment) and the notifications page show a person's own
notifications of their tenant in their language, "mark all read" marks them, and the pages cost a
fixed number of queries. Every page's header loads the bell without a query of its own."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone, translation

from apps.accounts.models import Role
from apps.notifications.compose import page_line
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.projections import changes_noticed, message_id_for, notifications_from_event
from apps.notifications.tests.conftest import add_member
from tests.factories import TenantFactory

pytestmark = pytest.mark.django_db


def _note(user, tenant, kind=NotificationKind.TICKET_CREATED, **context) -> Notification:
    n = Notification(tenant=tenant, recipient=user, kind=kind, status=DeliveryStatus.SKIPPED,
                     context={"ticket": "REF-000007", "asset_tag": "PRN-0417", **context})
    n.message_id = message_id_for(n.pk)
    n.save(force_insert=True)
    return n


def test_the_bell_shows_the_unread_count_and_the_newest_with_links(client, requester, tenant):
    for i in range(7):
        _note(requester, tenant, ticket=f"REF-00000{i}")
    client.force_login(requester)
    resp = client.get(reverse("notification-bell"), HTTP_HX_REQUEST="true")
    html = resp.content.decode()
    assert resp.status_code == 200 and "HX-Request" in resp["Vary"]
    assert '<span id="bell-count" class="badge" hx-swap-oob="true">7</span>' in html
    assert html.count("<li") == 5 and "Ticket REF-000006 was created for your report on PRN-0417" in html
    assert "Mark all read" in html


def test_mark_all_read_empties_the_badge(client, requester, tenant):
    _note(requester, tenant)
    client.force_login(requester)
    resp = client.post(reverse("notification-read-all"), HTTP_HX_REQUEST="true")
    assert '<span id="bell-count" class="badge muted" hx-swap-oob="true"></span>' in resp.content.decode()
    assert not Notification.objects.filter(read_at__isnull=True).exists()
    assert client.post(reverse("notification-read-all")).url == reverse("notification-list")


def test_the_page_lists_only_ones_own_of_ones_tenant_in_ones_language(client, requester, approver, tenant):
    mine = _note(requester, tenant)
    _note(approver, tenant, ticket="REF-999999")  # another person's
    globex = TenantFactory(slug="globex")
    gus = add_member(globex, "gus", Role.REQUESTER)
    _note(gus, globex, ticket="REF-888888")
    client.force_login(requester)
    html = client.get(reverse("notification-list")).content.decode()
    assert "REF-000007" in html and "REF-999999" not in html and "REF-888888" not in html
    assert html.count('class="unread"') == 1 and mine.message_id not in html
    client.force_login(gus)
    html = client.get(reverse("notification-bell")).content.decode()
    assert "REF-888888" in html and "REF-000007" not in html
    client.force_login(requester)
    html = client.get(reverse("notification-list"), HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()
    with translation.override("zh-hans"):
        words = page_line(mine)[0]
    assert words in html and re.search(r"[\u4e00-\u9fff]", words)


def test_the_page_and_the_bell_cost_a_fixed_number_of_queries(client, requester, tenant, django_assert_max_num_queries):
    for i in range(40):
        _note(requester, tenant, ticket=f"REF-{i:06d}")
    client.force_login(requester)
    with django_assert_max_num_queries(9):  # session, user, membership, count, page, unread, …
        assert client.get(reverse("notification-list")).status_code == 200
    with django_assert_max_num_queries(6):
        assert client.get(reverse("notification-bell")).status_code == 200


def test_every_page_header_polls_the_bell(client, requester):
    client.force_login(requester)
    html = client.get(reverse("request-list")).content.decode()
    assert f'hx-get="{reverse("notification-bell")}" hx-trigger="load, every 15s"' in html


def test_an_anonymous_visitor_is_sent_to_sign_in(client):
    for name in ("notification-list", "notification-bell"):
        resp = client.get(reverse(name))
        assert resp.status_code == 302 and "login" in resp.url


def test_most_events_cost_no_query(django_assert_num_queries):
    from types import SimpleNamespace

    state = {"status": "RETRIEVING", "receipt": None, "approval": None, "questions": None, "request": {}}
    task = SimpleNamespace(pk=None, tenant_id=1, requester_id=1, status="ACCEPTED", state={"status": "ACCEPTED"})
    with django_assert_num_queries(0):
        notifications_from_event(task, SimpleNamespace(id=None, seq=2), state)


@pytest.mark.parametrize("old_status,before,after,kinds", [
    ("VALIDATING", {}, {"status": "WAITING_INPUT", "questions": ["since when?"]}, ["input_requested"]),
    ("WAITING_INPUT", {}, {"status": "WAITING_INPUT", "questions": ["q"]}, []),
    ("DISPATCHING", {}, {"status": "DISPATCHING", "receipt": {"external_id": "REF-1"}}, ["ticket_created"]),
    ("DISPATCHING", {}, {"status": "DISPATCHING", "receipt": {"external_id": "REF-1-C1", "kind": "comment",
                                                              "ticket_id": "REF-1"}}, ["report_joined"]),
    ("DISPATCHING", {"receipt": {"external_id": "REF-1"}},
     {"status": "COMPLETED", "receipt": {"external_id": "REF-1"}, "termination_reason": "ticket_created"},
     ["task_ended"]),
    ("COMPENSATING", {"receipt": {"external_id": "REF-1"}},
     {"status": "CANCELLED", "receipt": {"external_id": "REF-1"}}, ["task_ended"]),  # what became of the ticket
    ("VALIDATING", {}, {"status": "WAITING_APPROVAL", "approval": {"id": "a1", "status": "PENDING"}},
     ["approval_waiting"]),
    ("VALIDATING", {}, {"status": "WAITING_APPROVAL", "approval": {"id": "a1", "status": "APPROVED"}}, []),
    ("CANCELLED", {"compensation": None}, {"status": "COMPENSATING", "compensation": {
        "status": "WAITING_APPROVAL", "approval": {"id": "c1", "status": "PENDING"}, "ticket": {"external_id": "R"}}},
     ["approval_waiting"]),
])
def test_what_each_change_notifies(old_status, before, after, kinds):
    assert [k for k, _ in changes_noticed(old_status, before, after)] == kinds


def test_a_compensation_that_ends_tells_what_became_of_the_ticket_and_a_rejection_says_why():
    [(kind, ctx)] = changes_noticed("COMPENSATING", {"receipt": {"external_id": "REF-1"}}, {
        "status": "CANCELLED", "receipt": {"external_id": "REF-1"},
        "compensation": {"ticket": {"external_id": "REF-1"}},
        "termination_reason": "cancelled: by request; compensation rejected by avery: ticket REF-1 left as it is"})
    assert kind == "task_ended" and ctx["after_cancel"] and ctx["ticket"] == "REF-1"
    [(kind, ctx)] = changes_noticed("WAITING_APPROVAL", {}, {
        "status": "COMPLETED", "termination_reason": "proposal_rejected",
        "approval": {"id": "a1", "status": "REJECTED", "reason": "duplicate of a phone call"}})
    assert ctx["approver_reason"] == "duplicate of a phone call"


def test_a_notification_is_dated_when_written(requester, tenant):
    n = _note(requester, tenant)
    assert abs((timezone.now() - n.created_at).total_seconds()) < 60


def test_a_recorded_reason_reads_in_the_readers_words_and_says_what_stays_as_recorded():
    from django.utils import translation

    from apps.notifications.compose import reason_for_reader

    assert reason_for_reader("cancelled: by request") == "cancelled: by request"
    with translation.override("zh-hans"):
        assert reason_for_reader("cancelled: by request") == "已取消（记录原文：by request）"
        assert reason_for_reader("proposal_rejected") == "提案被驳回"
        assert reason_for_reader("no readable evidence for this device and symptom") == \
            "记录原文：no readable evidence for this device and symptom"
        assert reason_for_reader("cancelled: 打印机已修好") == "已取消: 打印机已修好"
