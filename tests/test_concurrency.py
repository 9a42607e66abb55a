"""Two writers racing on the same task version (DESIGN.md §5): exactly one commit wins, the loser
gets StaleWrite, re-reads and never overwrites."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from apps.events.models import RefusedEvent, TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from apps.tasks.store import StaleWrite, task_append_event
from tests.conftest import p

pytestmark = pytest.mark.django_db(transaction=True)


def test_two_writers_on_one_version_exactly_one_wins(requester, device):
    for round_ in range(10):
        task = task_submit(principal=p(requester), device_id=device.pk, symptom=f"race {round_}").task
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def commit(name, event_type, payload, task=task, barrier=barrier, outcomes=outcomes):
            copy = Task.objects.get(pk=task.pk)  # both read version 1
            barrier.wait()
            try:
                task_append_event(task=copy, event_type=event_type, payload=payload, actor=name)
                outcomes[name] = "won"
            except StaleWrite:
                outcomes[name] = "lost"
            finally:
                connection.close()

        threads = [threading.Thread(target=commit, args=("a", "retrieval.started", {})),
                   threading.Thread(target=commit, args=("b", "cancel.requested", {"reason": "race"}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes.values()) == ["lost", "won"]
        winner = next(n for n, o in outcomes.items() if o == "won")
        loser = next(n for n, o in outcomes.items() if o == "lost")
        row = Task.objects.get(pk=task.pk)  # the loser re-reads: it sees the winner's state
        assert row.version == 2
        assert row.status == (reducer.RETRIEVING if winner == "a" else reducer.CANCELLED)
        assert TaskEvent.objects.get(task=row, seq=2).actor == winner
        assert RefusedEvent.objects.get(task=row).actor == loser
