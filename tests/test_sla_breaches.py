"""Service-level breaches recorded as events (apps/tasks/sla_breaches.py, ``reducer/4``): a request
not answered by its respond-by date and a ticket not resolved by its due date each get one
``sla.breached`` event, from the beat job, never twice, never while a worker holds the task, and
the task still replays to its state."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from apps.tasks.sla_breaches import sla_breaches_mark
from apps.tickets.models import SlaPolicy, TicketMirror
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
PRIORITIES = ("P1", "P2", "P3", "P4")


def _policy(tenant, respond: int, resolve: int) -> None:
    SlaPolicy.objects.create(tenant=tenant, workdays=list(range(7)),
                             targets={q: {"respond": respond, "resolve": resolve, "around_the_clock": True}
                                      for q in PRIORITIES})


def _filed_minutes_ago(requester, device, minutes: int) -> Task:
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    Task.objects.filter(pk=task.pk).update(created_at=timezone.now() - timedelta(minutes=minutes))
    return drive(task.pk)


@pytest.mark.django_db
def test_a_request_not_answered_in_time_gets_one_respond_breach(client, requester, admin_user, device, kb, tenant):
    _policy(tenant, respond=5, resolve=60)
    task = _filed_minutes_ago(requester, device, 10)
    assert task.status == reducer.WAITING_APPROVAL and reducer.supports(task.artifact_bundle["reducer"], "sla")
    assert sla_breaches_mark() == {"respond": 1, "resolve": 0}
    [event] = TaskEvent.objects.filter(task=task, type="sla.breached")
    assert event.payload["kind"] == "respond" and event.actor == "beat:sla"
    assert event.payload["due"] == (task.created_at + timedelta(minutes=5)).isoformat(timespec="seconds")
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.WAITING_APPROVAL and task.state["sla"]["respond"]["due"] == event.payload["due"]
    assert sla_breaches_mark() == {"respond": 0, "resolve": 0}  # once per kind
    assert task_replay(Task.objects.get(pk=task.pk)).ok
    client.force_login(admin_user)
    trace = client.get(f"/tasks/{task.pk}/trace/")
    assert trace.status_code == 200 and "sla.breached" in trace.content.decode()


@pytest.mark.django_db
def test_a_request_within_its_time_or_held_by_a_worker_is_left_alone(requester, device, kb, tenant):
    _policy(tenant, respond=60, resolve=600)
    in_time = _filed_minutes_ago(requester, device, 10)
    late = _filed_minutes_ago(requester, device, 90)
    Task.objects.filter(pk=late.pk).update(lease_owner="worker:elsewhere", lease_expires_at=timezone.now()
                                           + timedelta(seconds=30))
    assert sla_breaches_mark() == {"respond": 0, "resolve": 0}
    Task.objects.filter(pk=late.pk).update(lease_owner=None, lease_expires_at=None)
    assert sla_breaches_mark() == {"respond": 1, "resolve": 0}
    assert not TaskEvent.objects.filter(task=in_time, type="sla.breached").exists()


@pytest.mark.django_db
def test_a_ticket_still_open_past_its_due_date_gets_a_resolve_breach_after_its_task_ended(
        requester, approver, device, kb, tenant, refservice):
    _policy(tenant, respond=1, resolve=5)
    task = _filed_minutes_ago(requester, device, 10)  # its ticket was due 5 minutes after filing
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    mirror = TicketMirror.objects.get(action__task=task)
    assert mirror.status == "open"
    # answered after its respond-by too (filed 10 minutes ago, due in 1): both breaches, once each
    assert sla_breaches_mark() == {"respond": 1, "resolve": 1}
    [event] = TaskEvent.objects.filter(task=task, type="sla.breached", payload__kind="resolve")
    assert event.payload["kind"] == "resolve" and event.payload["due"] == mirror.action.params["due_at"]
    assert Task.objects.get(pk=task.pk).status == reducer.COMPLETED
    assert task_replay(Task.objects.get(pk=task.pk)).ok
    assert sla_breaches_mark() == {"respond": 0, "resolve": 0}


@pytest.mark.django_db
def test_a_resolved_ticket_is_no_breach(requester, approver, device, kb, tenant, refservice):
    _policy(tenant, respond=1, resolve=5)
    task = _filed_minutes_ago(requester, device, 10)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    TicketMirror.objects.filter(action__task=task).update(status="resolved")
    assert sla_breaches_mark()["resolve"] == 0  # (its answer came after its respond-by: that one is recorded)


@pytest.mark.django_db
@pytest.mark.allow_divergence  # the task's pinned reducer is rewritten to an older one on purpose
def test_tasks_pinned_to_an_older_reducer_are_not_touched(requester, device, kb, tenant):
    _policy(tenant, respond=5, resolve=60)
    task = _filed_minutes_ago(requester, device, 10)
    Task.objects.filter(pk=task.pk).update(artifact_bundle={**task.artifact_bundle, "reducer": "reducer/3"})
    assert sla_breaches_mark() == {"respond": 0, "resolve": 0}


def test_the_reducer_refuses_a_second_breach_of_a_kind_and_an_unknown_kind():
    state = {**reducer.initial_state(), "status": reducer.COMPLETED,
             "limits": {d: {"total": 1, "used": 0, "reserved": 0} for d in ("tokens", "tool_calls", "retries")}}
    once = reducer.reducer_for("reducer/4")(state, "sla.breached", {"kind": "resolve", "due": "x", "observed_at": "y"})
    assert once["sla"]["resolve"]["due"] == "x" and once["status"] == reducer.COMPLETED
    with pytest.raises(reducer.IllegalTransition):
        reducer.reducer_for("reducer/4")(once, "sla.breached", {"kind": "resolve", "due": "x", "observed_at": "z"})
    with pytest.raises(reducer.IllegalTransition):
        reducer.reducer_for("reducer/4")(state, "sla.breached", {"kind": "lunch", "due": "x", "observed_at": "y"})
    with pytest.raises(reducer.IllegalTransition):
        reducer.reducer_for("reducer/3")(state, "sla.breached", {"kind": "resolve", "due": "x", "observed_at": "y"})


def test_the_beat_runs_the_breach_job_every_minute():
    assert settings.CELERY_BEAT_SCHEDULE["sla-breaches"] == {"task": "mark_sla_breaches",
                                                             "schedule": timedelta(seconds=60)}
    assert settings.CELERY_TASK_ROUTES["mark_sla_breaches"] == {"queue": "agent"}


@pytest.mark.django_db
def test_one_tenants_unusable_policy_never_stops_anothers_breaches(requester, device, kb, tenant, other_tenant_user):
    from apps.accounts.models import Membership
    from tests.factories import DeviceFactory

    # the other tenant's policy was saved past the form (a raw update): a calendar that never works
    other = Membership.objects.get(user=other_tenant_user).tenant
    SlaPolicy.objects.create(tenant=other, timezone="Nowhere/Atlantis",
                             targets={q: {"around_the_clock": False} for q in PRIORITIES})
    other_device = DeviceFactory(tenant=other, asset_tag="PRN-0001")
    from apps.accounts.models import Role
    Membership.objects.filter(user=other_tenant_user).update(role=Role.REQUESTER)
    stuck = task_submit(principal=p(other_tenant_user), device_id=other_device.pk, symptom=SYMPTOM,
                        urgency="high").task
    Task.objects.filter(pk=stuck.pk).update(created_at=timezone.now() - timedelta(days=30))
    _policy(tenant, respond=5, resolve=60)
    late = _filed_minutes_ago(requester, device, 10)
    assert sla_breaches_mark(limit=1) == {"respond": 1, "resolve": 0}
    assert TaskEvent.objects.filter(task=late, type="sla.breached").exists()
    assert not TaskEvent.objects.filter(task=stuck, type="sla.breached").exists()


@pytest.mark.django_db
def test_the_beat_never_writes_over_a_worker_that_claimed_the_task_meanwhile(requester, device, kb, tenant):
    from unittest import mock

    from apps.tasks import sla_breaches
    from apps.tasks.leases import task_claim_read

    _policy(tenant, respond=5, resolve=60)
    task = _filed_minutes_ago(requester, device, 10)
    real = sla_breaches._record

    def claimed_first(task, *args, **kwargs):
        task_claim_read(task_id=task.pk, related=())  # a worker claims between the beat's read and write
        return real(task, *args, **kwargs)

    with mock.patch.object(sla_breaches, "_record", claimed_first):
        assert sla_breaches_mark() == {"respond": 0, "resolve": 0}
    assert not TaskEvent.objects.filter(task=task, type="sla.breached").exists()


@pytest.mark.django_db
def test_a_request_answered_late_between_two_beats_still_gets_its_breach(requester, approver, device, kb, tenant,
                                                                         refservice):
    _policy(tenant, respond=5, resolve=600)
    task = _filed_minutes_ago(requester, device, 10)  # due 5 minutes after filing: answered 5 minutes late
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    assert sla_breaches_mark() == {"respond": 1, "resolve": 0}
    [event] = TaskEvent.objects.filter(task=task, type="sla.breached")
    assert event.payload["kind"] == "respond"
    assert sla_breaches_mark() == {"respond": 0, "resolve": 0}


@pytest.mark.django_db
def test_a_request_answered_in_time_is_no_breach(requester, approver, device, kb, tenant, refservice):
    _policy(tenant, respond=60, resolve=600)
    task = _filed_minutes_ago(requester, device, 10)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    assert drive(task.pk).status == reducer.COMPLETED
    assert sla_breaches_mark() == {"respond": 0, "resolve": 0}
