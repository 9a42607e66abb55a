"""One ticket per fault (``reducer/4``'s ``intent.deferred``): reports for the same device while its
ticket is being created or is open join that ticket as comments, under the same approval rules,
instead of each creating a ticket — also when they all arrive at once (concurrent real requests,
concurrent workers); the requester sees which ticket their report joined."""

from __future__ import annotations

import base64
import threading
import time

import httpx
import pytest
from django.db import connections

from apps.actions.models import Action
from apps.approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p, reads_run

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
AUTO = {"tools": {"ticket.create": {"requires_approval": False, "ttl_minutes": 60},
                  "ticket.comment": {"requires_approval": False, "ttl_minutes": 60}}}


def _tickets(refservice) -> list[dict]:
    resp = httpx.get(f"{refservice.url}/_admin/tickets", headers={"Authorization": "Bearer test-key"})
    return resp.json()["results"]


@pytest.mark.django_db
def test_a_second_report_approved_after_the_first_joins_its_ticket_as_a_comment(requester, approver, device, kb,
                                                                                refservice):
    first = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    second = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM + " Again.",
                               urgency="high").task.pk)
    # both proposed a new ticket: neither existed when they read the device's open ticket
    assert [t.state["proposal"]["tool"] for t in (first, second)] == ["ticket.create", "ticket.create"]
    for task in (first, second):
        approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                        decision="approve", reason="ok")
    first = drive(first.pk)
    assert first.status == reducer.COMPLETED and first.state["receipt"].get("kind") != "comment"
    ticket_id = first.state["receipt"]["external_id"]
    second = drive(second.pk)
    # the approved create was not sent: the report re-planned as a comment, which needs its own decision
    deferred = TaskEvent.objects.get(task=second, type="intent.deferred")
    assert deferred.payload["task_id"] == str(first.pk)
    assert ApprovalRequest.objects.get(task=second, tool="ticket.create").status == ApprovalStatus.INVALIDATED
    assert second.status == reducer.WAITING_APPROVAL and second.state["proposal"]["tool"] == "ticket.comment"
    assert second.state["proposal"]["params"]["ticket_id"] == ticket_id
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(
        task=second, tool="ticket.comment").pk, decision="approve", reason="same fault")
    second = drive(second.pk)
    assert second.status == reducer.COMPLETED
    assert second.state["receipt"]["kind"] == "comment" and second.state["receipt"]["ticket_id"] == ticket_id
    assert len(_tickets(refservice)) == 1


@pytest.mark.django_db
def test_a_report_for_another_device_still_gets_its_own_ticket(requester, device, kb, refservice, tenant):
    from tests.factories import DeviceFactory

    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=AUTO)
    other = DeviceFactory(tenant=tenant, asset_tag="PRN-0999")
    a = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    b = drive(task_submit(principal=p(requester), device_id=other.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert a.status == b.status == reducer.COMPLETED
    assert all(t.state["receipt"].get("kind") != "comment" for t in (a, b))
    assert len(_tickets(refservice)) == 2
    assert not TaskEvent.objects.filter(type="intent.deferred").exists()


@pytest.mark.django_db(transaction=True)
def test_six_concurrent_reports_for_one_device_make_one_ticket_and_five_comments(live_server, requester, device, kb,
                                                                                 refservice, tenant):
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=AUTO)
    requester.set_password("pw-race")
    requester.save()
    auth = {"Authorization": "Basic " + base64.b64encode(b"riley:pw-race").decode()}
    ids, errors = [], []
    barrier = threading.Barrier(6)

    def file(i: int) -> None:
        barrier.wait()
        resp = httpx.post(f"{live_server.url}/api/tasks/", json={"device_id": device.pk, "urgency": "high",
                          "symptom": f"{SYMPTOM} Report {i} from the same floor."},
                          headers={**auth, "Idempotency-Key": f"race-{i}"}, timeout=30)
        (ids if resp.status_code == 201 else errors).append(resp.json().get("id") or resp.text)

    threads = [threading.Thread(target=file, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(ids) == 6

    # six workers, one task each, all at once: they reach their intents together
    start = threading.Barrier(6)

    def work(task_id: str) -> None:
        try:
            start.wait()
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                task = drive(task_id, rounds=3)
                if task.status in reducer.TERMINAL:
                    return
                time.sleep(0.05)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=work, args=(i,)) for i in ids]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    tasks = list(Task.objects.filter(pk__in=ids))
    assert {t.status for t in tasks} == {reducer.COMPLETED}, [(t.pk, t.status, t.termination_reason) for t in tasks]
    creates = Action.objects.filter(task__in=tasks, tool="ticket.create", status="SUCCEEDED")
    comments = Action.objects.filter(task__in=tasks, tool="ticket.comment", status="SUCCEEDED")
    assert creates.count() == 1 and comments.count() == 5
    [ticket] = _tickets(refservice)
    assert ticket["id"] == creates.get().external_id
    joined = [t for t in tasks if t.state["receipt"].get("kind") == "comment"]
    assert len(joined) == 5 and {t.state["receipt"]["ticket_id"] for t in joined} == {ticket["id"]}


def test_the_requester_is_told_their_report_waits_to_join_another_reports_ticket():
    from django.utils import translation

    from apps.tasks.selectors import task_now

    waiting = Task(status=reducer.RETRIEVING, state={"coalesce": {"action_id": "a", "task_id": "t", "reason": ""}})
    with translation.override("en"):
        assert task_now(waiting).startswith("Another report about this device is creating its ticket")
    with translation.override("zh-hans"):
        assert task_now(waiting).startswith("另一份关于此设备的报告正在创建工单")


def _agent_only(task_id, rounds=10):
    """The agent and tools steps only (no outbox): intents commit, nothing is sent."""
    from apps.agent.runner import agent_run, context_read

    task = None
    for _ in range(rounds):
        agent_run(task_id=task_id)
        context_read(task_id=task_id)
        reads_run(task_id)  # the reads, each an activity of its own
        task = Task.objects.get(pk=task_id)
    return task


@pytest.mark.django_db
def test_a_burst_of_eight_reports_makes_one_ticket_and_loses_none(requester, device, kb, refservice, tenant):
    """The joiners' comments all planned on one ticket version conflict one after the other (412):
    contention counted under its own bound, never a lost report."""
    from apps.outbox.dispatch import outbox_dispatch_batch
    from tests.conftest import settle_receipts

    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=AUTO)
    ids = [task_submit(principal=p(requester), device_id=device.pk, symptom=f"{SYMPTOM} Report {i}.",
                       urgency="high").task.pk for i in range(8)]
    for _ in range(40):
        for task_id in ids:
            _agent_only(task_id, rounds=2)
        outbox_dispatch_batch()
        settle_receipts()
        if all(Task.objects.get(pk=t).status in reducer.TERMINAL for t in ids):
            break
    tasks = [Task.objects.get(pk=t) for t in ids]
    assert {t.status for t in tasks} == {reducer.COMPLETED}, [(t.status, t.termination_reason) for t in tasks]
    assert len(_tickets(refservice)) == 1
    assert sum(t.state["receipt"].get("kind") == "comment" for t in tasks) == 7


@pytest.mark.django_db
def test_a_report_behind_a_ticket_being_taken_back_files_its_own(committed, requester, device, kb, refservice,
                                                                 refadmin, tenant):
    """The first request was cancelled after its ticket was created; its compensation is pending. A new
    report must not join (nor wait behind) a ticket about to be closed: it files its own."""
    from tests.conftest import created_then_cancelled

    first = created_then_cancelled(committed.pk, canceller=requester, refadmin=refadmin)
    assert first.status == reducer.COMPENSATING
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=AUTO)
    second = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM + " Again.",
                               urgency="high").task.pk, rounds=60)
    assert second.status == reducer.COMPLETED and second.state["receipt"].get("kind") != "comment"
    assert not TaskEvent.objects.filter(task=second, type="intent.deferred").exists()


@pytest.mark.django_db
def test_a_waiting_report_is_not_requeued_until_the_create_it_waits_for_settles(requester, device, kb, tenant,
                                                                               refservice, settings):
    from datetime import timedelta

    from django.utils import timezone

    from apps.agent.sweeper import tasks_needing_work
    from apps.outbox.dispatch import outbox_dispatch_batch

    settings.FAULTDESK = {**settings.FAULTDESK, "OUTBOX_DIRECT_DELIVERY": False}  # the first create stays queued
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=AUTO)
    first = _agent_only(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM,
                                    urgency="high").task.pk)
    assert first.status == reducer.DISPATCHING
    second = _agent_only(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM + " Again.",
                                     urgency="high").task.pk)
    assert second.status == reducer.RETRIEVING and second.state["coalesce"]["task_id"] == str(first.pk)
    Task.objects.filter(pk=second.pk).update(updated_at=timezone.now() - timedelta(minutes=5))

    def swept() -> list[str]:
        return [i for _s, i in tasks_needing_work(now=timezone.now(), idle=timedelta(seconds=10))]

    assert str(second.pk) not in swept()  # nothing to do while the create is in flight
    outbox_dispatch_batch()
    assert Action.objects.get(task=first).status == "SUCCEEDED"
    assert str(second.pk) in swept()
    second = drive(second.pk)
    assert second.status == reducer.COMPLETED and second.state["receipt"].get("kind") == "comment"
