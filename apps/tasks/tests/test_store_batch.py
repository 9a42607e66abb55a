"""Appending one event to each of several tasks in one transaction (``task_events_prepare`` /
``task_events_commit``, DESIGN.md §4): the same CAS, seq, ledger and replay guarantees as one
event at a time, all or nothing."""

from __future__ import annotations

import pytest
from django.db import transaction

from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from apps.tasks.store import StaleWrite, task_append_with_retry, task_events_commit, task_events_prepare
from tests.conftest import p
from tests.factories import DeviceFactory


@pytest.fixture
def three_tasks(tenant, requester):
    out = []
    for i in range(3):
        device = DeviceFactory(tenant=tenant, asset_tag=f"PRN-9{i}")
        out.append(task_submit(principal=p(requester), device_id=device.pk, urgency="low",
                               symptom=f"报告 {i}: the printer shows E{i}").task)
    return out


def _cancel(task_id, reason="batch"):
    return (task_id, "cancel.requested", lambda t: {"reason": f"{reason} v{t.version}"}, "user:test")


def test_a_batch_appends_one_event_per_task_at_the_next_seq_and_replays(three_tasks):
    before = {t.pk: t.version for t in three_tasks}
    with transaction.atomic():
        prepared, refused = task_events_prepare([_cancel(t.pk) for t in three_tasks])
        assert refused == []
        events = task_events_commit(prepared)
    assert [e.task_id for e in events] == [p.task.pk for p in prepared]
    for task in three_tasks:
        row = Task.objects.get(pk=task.pk)
        assert row.version == before[task.pk] + 1
        assert row.state["cancel_requested"]
        event = TaskEvent.objects.get(task=task, seq=row.version)
        # the payload was built from the task as locked and read
        assert (event.type, event.payload["reason"]) == ("cancel.requested", f"batch v{before[task.pk]}")
        assert task_replay(row).ok
    # the in-memory tasks follow their rows once committed
    assert {x.task.pk: x.task.version for x in prepared} == {t.pk: before[t.pk] + 1 for t in three_tasks}


def test_an_event_the_reducer_refuses_is_left_out_and_the_rest_are_appended(three_tasks):
    done = three_tasks[1]
    task_append_with_retry(task_id=done.pk, event_type="cancel.requested", payload_fn=lambda t: {"reason": "x"},
                           actor="user:test")
    assert Task.objects.get(pk=done.pk).status == reducer.CANCELLED
    with transaction.atomic():
        prepared, refused = task_events_prepare([_cancel(t.pk) for t in three_tasks])
        task_events_commit(prepared)
    assert [r[0] for r in refused] == [done.pk]
    assert {x.task.pk for x in prepared} == {three_tasks[0].pk, three_tasks[2].pk}


def test_a_lost_cas_fails_the_whole_batch_and_writes_nothing(three_tasks):
    before = {t.pk: Task.objects.get(pk=t.pk).version for t in three_tasks}
    with pytest.raises(StaleWrite), transaction.atomic():
        prepared, _ = task_events_prepare([_cancel(t.pk) for t in three_tasks])
        prepared[2].task.version -= 1  # as if read before another writer's commit
        task_events_commit(prepared)
    assert {t.pk: Task.objects.get(pk=t.pk).version for t in three_tasks} == before
    assert not TaskEvent.objects.filter(type="cancel.requested").exists()


def test_a_batch_names_each_task_once(three_tasks):
    with pytest.raises(ValueError, match="one event per task"), transaction.atomic():
        task_events_prepare([_cancel(three_tasks[0].pk), _cancel(three_tasks[0].pk)])


@pytest.mark.django_db(transaction=True)
def test_a_batch_outside_a_transaction_is_refused_and_writes_nothing(three_tasks):
    with pytest.raises(transaction.TransactionManagementError):
        task_events_prepare([_cancel(three_tasks[0].pk)])
    assert not TaskEvent.objects.filter(type="cancel.requested").exists()
