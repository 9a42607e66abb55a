"""The retention purge (apps/retention/purge.py): each tenant's policy, in batches, never touching
what an open task, an unreconciled action or the idempotency window still needs; a purged task keeps
its event skeleton and replays as "purged"."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.urls import reverse
from django.utils import timezone, translation

from apps.actions.audit import task_actions_audit
from apps.actions.models import Action, ActionAttempt, ActionStatus
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent, TaskSnapshot
from apps.outbox.models import OutboxMessage
from apps.retention.models import PurgeRun, RetentionPolicy
from apps.retention.purge import purge_run
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.retention import KEEP_STATE_KEYS
from apps.tasks.services import task_submit
from apps.tickets.models import InboundWebhook
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _completed(requester, approver, device) -> Task:
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    return task


def _age(task: Task, days: float, *, actions_days: float | None = None) -> None:
    """Move the task's clock (and its actions', attempts', outbox rows') ``days`` back."""
    then = timezone.now() - timedelta(days=days)
    Task.objects.filter(pk=task.pk).update(updated_at=then)
    acts = Action.objects.filter(task=task)
    acts.update(created_at=timezone.now() - timedelta(days=actions_days if actions_days is not None else days))
    ActionAttempt.objects.filter(action__task=task).update(finished_at=then, started_at=then)
    OutboxMessage.objects.filter(action__task=task).update(delivered_at=then, created_at=then)


def test_a_finished_task_past_its_payload_retention_keeps_only_its_skeleton(
        requester, approver, device, kb, refservice, client, admin_user):
    task = _completed(requester, approver, device)
    events_before = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", "type",
                                                                                          "payload_digest"))
    _age(task, 200)
    run = purge_run()
    assert run.complete and run.tasks == {"excerpts": 0, "payload": 1}
    record = PurgeRun.objects.get()
    assert (record.tenant_id, record.tasks, record.tables) == (task.tenant_id, run.tasks, run.tables)
    task = Task.objects.get(pk=task.pk)
    assert (task.purged, task.symptom) == ("payload", "")
    events = list(TaskEvent.objects.filter(task=task).order_by("seq"))
    assert [(e.seq, e.type, e.payload_digest) for e in events] == events_before
    assert all(e.payload == {} and e.purged == "payload" for e in events)
    assert not TaskSnapshot.objects.filter(task=task).exists()
    assert set(k for k, v in task.state.items() if v not in ({}, [], "", None)) <= KEEP_STATE_KEYS
    assert task.state["status"] == reducer.COMPLETED and task.state["receipt"]["external_id"]
    assert SYMPTOM not in str(task.state)
    result = task_replay(task)
    assert (result.ok, result.purged, result.events) == (True, "payload", len(events_before))
    assert task_actions_audit(task) == []
    # the action row — key, digest, receipt — stays; its attempts and outbox row are gone
    action = Action.objects.get(task=task)
    assert action.status == ActionStatus.SUCCEEDED and action.idempotency_key and action.external_id
    assert not ActionAttempt.objects.filter(action=action).exists()
    assert not OutboxMessage.objects.filter(action=action).exists()
    tables = run.tables
    assert tables["events_taskevent"]["rows"] == len(events_before) and tables["events_taskevent"]["bytes"] > 0
    assert tables["tasks_task"]["rows"] == 1 and tables["tasks_task"]["bytes"] > 0
    # the pages of a purged task still answer
    client.force_login(admin_user)
    trace = client.get(reverse("task-trace", args=[task.pk]))
    assert trace.status_code == 200 and 'data-purged="payload"' in trace.content.decode()
    client.force_login(requester)
    page = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "were purged on" in page and "under the retention policy" in page
    with translation.override("en"):  # the request activates Chinese in this thread; put English back after
        zh = client.get(reverse("task-detail", args=[task.pk]), HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()
    assert "保留策略" in zh
    # nothing left to do: a second run purges nothing
    again = purge_run()
    assert again.tasks == {"excerpts": 0, "payload": 0} and again.tables == {}


def test_evidence_excerpts_go_first_and_the_rest_of_the_record_stays(requester, approver, device, kb, refservice):
    task = _completed(requester, approver, device)
    assert any(r["excerpt"] for r in task.state["evidence"])
    _age(task, 40)  # past the 30 days of excerpts, inside the 180 of payloads and the key window
    run = purge_run()
    assert run.tasks == {"excerpts": 1, "payload": 0}
    task = Task.objects.get(pk=task.pk)
    assert task.purged == "excerpts" and task.symptom == SYMPTOM
    assert all(r["excerpt"] == "" for r in task.state["evidence"])
    assert task.state["answer"]["knowledge"]["quotes"] == []
    assert task.state["request"]["symptom"] == SYMPTOM and task.state["draft"]["ticket"]["title"]
    retrieved = TaskEvent.objects.get(task=task, type="evidence.retrieved")
    assert retrieved.purged == "excerpts" and all(r["excerpt"] == "" for r in retrieved.payload["refs"])
    untouched = TaskEvent.objects.get(task=task, type="task.accepted")
    assert untouched.purged == "" and untouched.payload["request"]["symptom"] == SYMPTOM
    result = task_replay(task)
    assert (result.ok, result.purged) == (True, "excerpts")


def test_nothing_an_open_task_or_an_unreconciled_action_needs_is_touched(
        requester, approver, device, kb, refservice):
    waiting = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert waiting.status == reducer.WAITING_APPROVAL
    done = _completed(requester, approver, device)
    Action.objects.filter(task=done).update(status=ActionStatus.UNKNOWN)
    for t in (waiting, done):
        _age(t, 400)
    run = purge_run()
    assert run.tasks == {"excerpts": 0, "payload": 0}
    assert Task.objects.filter(purged="").count() == 2
    assert ActionAttempt.objects.filter(action__task=done).exists()
    assert OutboxMessage.objects.filter(action__task=done).exists()


def test_the_idempotency_window_holds_whatever_the_policy_says(requester, approver, device, kb, refservice, tenant):
    RetentionPolicy.objects.create(tenant=tenant, excerpts_days=1, payloads_days=1, attempts_days=1, outbox_days=1)
    task = _completed(requester, approver, device)
    _age(task, 10, actions_days=20)  # the action is 20 days old: inside the 35-day key window
    run = purge_run()
    assert run.tasks == {"excerpts": 1, "payload": 0}  # excerpts go; what explains the action stays
    assert ActionAttempt.objects.filter(action__task=task).exists()
    assert OutboxMessage.objects.filter(action__task=task).exists()
    _age(task, 10, actions_days=36)
    assert purge_run().tasks == {"excerpts": 0, "payload": 1}
    assert not ActionAttempt.objects.filter(action__task=task).exists()


def test_webhooks_go_at_the_cutoff_but_a_deduplication_record_stays_for_the_key_window(tenant):
    now = timezone.now()
    rows = [InboundWebhook.objects.create(source="reference", event_id=f"e{i}", verified=verified, outcome="APPLIED",
                                          tenant=tenant) for i, verified in enumerate([True, False, True])]
    InboundWebhook.objects.filter(pk=rows[0].pk).update(received_at=now - timedelta(days=31))  # dedup, in window
    InboundWebhook.objects.filter(pk=rows[1].pk).update(received_at=now - timedelta(days=31))  # unverified
    InboundWebhook.objects.filter(pk=rows[2].pk).update(received_at=now - timedelta(days=40))  # past the window
    run = purge_run()
    assert list(InboundWebhook.objects.values_list("event_id", flat=True)) == ["e0"]
    assert run.tables["tickets_inboundwebhook"]["rows"] == 2


def test_a_task_someone_holds_is_skipped_not_waited_for(requester, approver, device, kb, refservice, transactional_db):
    first, second = _completed(requester, approver, device), _completed(requester, approver, device)
    for t in (first, second):
        _age(t, 200)
    locked, release = threading.Event(), threading.Event()

    def hold():
        conn = connections.create_connection("default")
        try:
            conn.set_autocommit(False)
            with conn.cursor() as cur:
                cur.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [first.pk])
                locked.set()
                release.wait(30)
            conn.rollback()
        finally:
            conn.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        run = purge_run()
        assert run.tasks["payload"] == 1
        assert Task.objects.get(pk=first.pk).purged == "" and Task.objects.get(pk=second.pk).purged == "payload"
    finally:
        release.set()
        holder.join()
    assert purge_run().tasks["payload"] == 1
    assert Task.objects.get(pk=first.pk).purged == "payload"


def test_two_runs_never_overlap_and_a_dead_runs_lease_expires(tenant):
    with connection.cursor() as cur:
        cur.execute("INSERT INTO retention_purge_lease (id, holder, expires_at) VALUES (1, 'other', now() + "
                    "interval '1 minute')")
    assert purge_run() is None
    with connection.cursor() as cur:  # the other run died: its lease runs out
        cur.execute("UPDATE retention_purge_lease SET expires_at = now() - interval '1 second'")
    summary = purge_run(time_budget_seconds=0)
    assert summary is not None and not summary.complete
    assert [r.tenant_id for r in summary.records] == [tenant.pk, None]  # stopped early: recorded
    with connection.cursor() as cur:  # given back at the end
        cur.execute("SELECT expires_at < clock_timestamp() FROM retention_purge_lease")
        assert cur.fetchone()[0] is True


def test_a_run_stops_at_its_time_budget_and_the_next_goes_on(requester, approver, device, kb, refservice):
    tasks = [_completed(requester, approver, device) for _ in range(3)]
    for t in tasks:
        _age(t, 200)
    first = purge_run(time_budget_seconds=0)
    assert not first.complete and first.tasks == {"excerpts": 0, "payload": 0}
    second = purge_run(batch_size=2)
    assert second.complete and second.tasks["payload"] == 3
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM tasks_task WHERE purged = 'payload'")
        assert cur.fetchone()[0] == 3


@pytest.mark.parametrize("field", ["excerpts_days", "payloads_days", "outbox_days", "notifications_days"])
def test_a_policy_of_zero_days_is_refused(tenant, field):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError):
        RetentionPolicy(tenant=tenant, **{field: 0}).full_clean()


def _breach(task):
    from apps.tasks.store import task_append_event

    now = timezone.now().isoformat()
    return task_append_event(task=task, event_type="sla.breached", actor="system:sla",
                             payload={"kind": "resolve", "due": now, "observed_at": now, "priority": "P2"})


def test_a_writer_that_read_the_task_before_the_purge_cannot_write_the_old_state_back(
        requester, approver, device, kb, refservice):
    from apps.tasks.store import StaleWrite

    task = _completed(requester, approver, device)
    _age(task, 200)
    stale = Task.objects.get(pk=task.pk)  # e.g. the SLA beat read it
    assert stale.state["evidence"]
    assert purge_run().tasks["payload"] == 1
    with pytest.raises(StaleWrite):
        _breach(stale)
    fresh = Task.objects.get(pk=task.pk)
    assert fresh.state["evidence"] == [] and fresh.version == stale.version
    appended = _breach(fresh)  # read again, the same event goes on the purged state
    assert appended.purged == "payload" and appended.state["evidence"] == [] and "sla" in appended.state


def test_events_a_purged_task_takes_later_are_purged_too(requester, approver, device, kb, refservice):
    task = _completed(requester, approver, device)
    _age(task, 200)
    purge_run()
    task = _breach(Task.objects.get(pk=task.pk))
    late = TaskEvent.objects.get(task=task, seq=task.version)
    assert late.purged == "" and late.payload["kind"] == "resolve"
    assert purge_run().tasks["payload"] == 0  # its clock restarted with the event
    Task.objects.filter(pk=task.pk).update(updated_at=timezone.now() - timedelta(days=200))
    assert purge_run().tasks["payload"] == 1
    late.refresh_from_db()
    assert (late.purged, late.payload) == ("payload", {})
    assert task_replay(Task.objects.get(pk=task.pk)).ok
    assert purge_run().tasks["payload"] == 0  # and not again


def test_an_open_tasks_attempts_and_outbox_rows_stay_however_old(requester, approver, device, kb, refservice):
    task = _completed(requester, approver, device)
    _age(task, 400)
    Task.objects.filter(pk=task.pk).update(status=reducer.WAITING_COMPENSATION)  # waiting for a person, no deadline
    purge_run()
    assert ActionAttempt.objects.filter(action__task=task).exists()
    assert OutboxMessage.objects.filter(action__task=task).exists()
    Task.objects.filter(pk=task.pk).update(status=reducer.COMPLETED)


def test_a_run_that_fails_part_way_records_what_it_purged(requester, approver, device, kb, refservice, monkeypatch):
    from apps.tasks import retention as task_retention

    tasks = [_completed(requester, approver, device) for _ in range(2)]
    for t in tasks:
        _age(t, 200)
    real, calls = task_retention.purged_state, []

    def failing(state, level):
        calls.append(level)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(state, level)

    monkeypatch.setattr(task_retention, "purged_state", failing)
    with pytest.raises(RuntimeError):
        purge_run(batch_size=1)
    record = PurgeRun.objects.get()
    assert (record.complete, record.tasks["payload"], record.skipped) == (False, 1, {"error": 1})
    assert sorted(Task.objects.values_list("purged", flat=True)) == ["", "payload"]


def test_the_notifications_field_falls_back_to_its_setting_and_the_admin_shows_it(tenant, client, admin_user,
                                                                                 settings):
    from apps.retention.purge import policy_days

    settings.FAULTDESK = {**settings.FAULTDESK,
                          "RETENTION": {**settings.FAULTDESK["RETENTION"], "notifications_days": 45}}
    assert policy_days(None)["notifications_days"] == 45
    policy = RetentionPolicy.objects.create(tenant=tenant, notifications_days=12)
    assert policy_days(policy)["notifications_days"] == 12
    client.force_login(admin_user)
    page = client.get(reverse("admin:retention_retentionpolicy_change", args=[policy.pk])).content.decode()
    assert 'name="notifications_days"' in page and 'value="12"' in page
