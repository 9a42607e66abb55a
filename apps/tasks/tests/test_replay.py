"""``python manage.py replay``: OK for a consistent task, non-zero naming the first divergent event
for a tampered one (DESIGN.md §4, invariant 7)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p


@pytest.fixture
def waiting_task(requester, device, kb):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    return drive(task.pk)


def test_replay_ok_for_one_and_all(waiting_task):
    out = StringIO()
    call_command("replay", str(waiting_task.pk), stdout=out)
    assert f"OK {waiting_task.pk}: " in out.getvalue()
    out = StringIO()
    call_command("replay", "--all", stdout=out)
    assert "1 of 1 tasks replay to their materialized state" in out.getvalue()


def test_replay_uses_the_latest_snapshot(waiting_task):
    # Test settings snapshot every 4 events: replay starts from the newest one.
    latest = waiting_task.snapshots.order_by("-seq").first()
    assert latest is not None and latest.seq % 4 == 0 and latest.seq > waiting_task.version - 4
    out = StringIO()
    call_command("replay", str(waiting_task.pk), stdout=out)
    assert f"after snapshot {latest.seq}" in out.getvalue()


@pytest.mark.allow_divergence
def test_replay_names_the_first_divergent_event(waiting_task):
    Task.objects.filter(pk=waiting_task.pk).update(version=waiting_task.version - 2)
    out = StringIO()
    with pytest.raises(CommandError, match="1 task"):
        call_command("replay", "--all", "--no-snapshot", stdout=out)
    assert f"first divergent event seq {waiting_task.version - 1}" in out.getvalue()


def test_replay_needs_an_argument(db):
    with pytest.raises(CommandError, match="TASK_ID or --all"):
        call_command("replay")


def test_replay_rejects_a_malformed_id(db):
    with pytest.raises(CommandError, match="not a task id"):
        call_command("replay", "not-a-uuid")


@pytest.fixture
def completed_task(requester, approver, device, kb, refservice):
    from apps.approvals.models import ApprovalRequest
    from apps.approvals.services import approval_decide

    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    task = drive(task.pk)
    approval = ApprovalRequest.objects.get(task=task)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    return drive(task.pk)


def test_replay_remote_checks_every_action_against_the_ticket_system(completed_task):
    out = StringIO()
    call_command("replay", "--all", "--remote", stdout=out)
    assert "1 of 1 tasks have action records that agree with their state and the ticket system" in out.getvalue()


@pytest.mark.allow_divergence
def test_replay_remote_reports_an_action_recorded_not_executed_whose_ticket_exists(completed_task):
    from apps.actions.models import Action, ActionStatus

    action = Action.objects.get(task=completed_task)
    Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT)
    out = StringIO()
    with pytest.raises(CommandError, match="1 task\\(s\\) with disagreeing action records"):
        call_command("replay", str(completed_task.pk), "--remote", stdout=out)
    text = out.getvalue()
    assert f"ACTIONS {completed_task.pk}: action {action.pk}: state says SUCCEEDED, row says NOT_SENT" in text
    assert f"is recorded NOT_SENT (not executed) but the remote holds ticket {action.external_id}" in text


@pytest.mark.allow_divergence
def test_replay_remote_reports_a_receipt_the_remote_does_not_hold(completed_task, refadmin):
    refadmin.client.post("/_admin/reset")
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("replay", "--all", "--remote", stdout=out)
    assert "the remote has none for its key" in out.getvalue()
    assert "0 of 1 tasks have action records that agree" in out.getvalue()


def test_replay_remote_fails_clearly_when_the_ticket_system_is_down(completed_task, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_URL": "http://127.0.0.1:9"}
    with pytest.raises(CommandError, match="the ticket system could not be asked"):
        call_command("replay", "--all", "--remote", stdout=StringIO())


@pytest.mark.allow_divergence
def test_a_payload_jsonb_turned_into_an_integer_beyond_2_53_is_reported_not_raised(waiting_task):
    """jsonb stores numbers as numerics: a float 1e16 written by an event (digested as JCS's
    "10000000000000000") reads back as the integer 10**16, which JCS cannot carry. Replay names the
    event instead of crashing."""
    from apps.events.models import TaskEvent
    from apps.tasks.replay import task_replay

    event = TaskEvent.objects.filter(task=waiting_task).order_by("seq").last()
    TaskEvent.objects.filter(pk=event.pk).update(payload={**event.payload, "reading": 1e16})
    assert TaskEvent.objects.get(pk=event.pk).payload["reading"] == 10**16  # what jsonb gives back
    result = task_replay(Task.objects.get(pk=waiting_task.pk), use_snapshot=False)
    assert not result.ok and result.divergent_seq == event.seq
    assert "no longer has a canonical form" in result.detail
