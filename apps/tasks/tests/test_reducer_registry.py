"""Tasks are replayed and continued with the reducer version pinned in their artifact bundle, or
through an explicit, registered event migration — never silently with new logic."""

from __future__ import annotations

import pytest

from apps.events.models import RefusedEvent, TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from apps.tasks.store import task_append_event
from tests.conftest import p


@pytest.fixture
def old_task(requester, device):
    """A task whose events were written by a retired ``reducer/0`` that called retrieval.started
    ``retrieval.begun``."""
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="old task").task
    task = task_append_event(task=task, event_type="retrieval.started", payload={}, actor="old-worker")
    TaskEvent.objects.filter(task=task, seq=2).update(type="retrieval.begun")
    bundle = {**task.artifact_bundle, "reducer": "reducer/0"}
    Task.objects.filter(pk=task.pk).update(artifact_bundle=bundle)
    return Task.objects.get(pk=task.pk)


@pytest.mark.allow_divergence
def test_a_task_pinned_to_an_unknown_reducer_is_reported_not_replayed(old_task):
    result = task_replay(old_task)
    assert not result.ok and "reducer/0" in result.detail
    with pytest.raises(reducer.IllegalTransition, match="reducer/0"):
        task_append_event(task=old_task, event_type="cancel.requested", payload={}, actor="new-worker")
    assert RefusedEvent.objects.filter(task=old_task, type="cancel.requested").exists()
    assert Task.objects.get(pk=old_task.pk).status == reducer.RETRIEVING


def test_an_explicit_migration_replays_the_old_log(old_task, monkeypatch):
    def rename(events):
        return [("retrieval.started" if t == "retrieval.begun" else t, p) for t, p in events]

    monkeypatch.setitem(reducer.MIGRATIONS, "reducer/0", ("reducer/6", rename))
    result = task_replay(old_task)
    assert result.ok, result.detail
    assert result.detail == "migrated reducer/0 → reducer/6"
    assert reducer.migrate_events("reducer/0", [("retrieval.begun", {})]) == ("reducer/6",
                                                                               [("retrieval.started", {})])
    with pytest.raises(reducer.UnknownReducer):
        reducer.migrate_events("reducer/-1", [])
