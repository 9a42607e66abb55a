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
    # Test settings snapshot every 4 events; the task has 6.
    assert waiting_task.snapshots.exists()
    out = StringIO()
    call_command("replay", str(waiting_task.pk), stdout=out)
    assert "after snapshot 4" in out.getvalue()


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
