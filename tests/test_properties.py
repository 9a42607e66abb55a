"""Property tests over generated event sequences, committed through the real CAS path into the
database (DESIGN.md §12 invariants 1, 3, 4 and 7). The reducer-level properties are in
``apps/tasks/tests/test_reducer_v1.py``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from apps.tasks.store import task_append_event
from apps.tasks.tests.test_reducer_v1 import EVENTS_FOR_FUZZ
from tests.conftest import p

pytestmark = pytest.mark.property


@pytest.mark.no_trajectory_check  # fuzzed logs: their evidence refs are stubs no drafter could draft from
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=st.lists(st.sampled_from(EVENTS_FOR_FUZZ), max_size=14))
def test_committed_event_logs_keep_invariants_1_3_4_7(requester, device, events):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="generated").task
    cancelled_at = None
    for etype, payload in events:
        current = Task.objects.get(pk=task.pk)
        before_version, before_status = current.version, current.status
        try:
            task = task_append_event(task=current, event_type=etype, payload=payload, actor="property")
        except reducer.IllegalTransition:
            task = Task.objects.get(pk=task.pk)
            assert (task.version, task.status) == (before_version, before_status)  # refused: nothing applied
            continue
        # 4. the version increases by exactly one per event, and seqs are 1..n without gaps
        assert task.version == before_version + 1
        assert task.version == TaskEvent.objects.filter(task_id=task.pk).count()
        # 1. a terminal state never changes
        if before_status in reducer.TERMINAL:
            assert task.status == before_status
        # 3. after cancel, no new action starts
        if task.status == reducer.CANCELLED and cancelled_at is None:
            cancelled_at = task.version
        if cancelled_at is not None and task.version > cancelled_at:
            assert etype != "intent.committed"
    seqs = list(TaskEvent.objects.filter(task_id=task.pk).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, task.version + 1))
    # 7. replay(events) == materialized state, from the first event and from the newest snapshot
    row = Task.objects.get(pk=task.pk)
    assert task_replay(row, use_snapshot=False).ok
    assert task_replay(row).ok
