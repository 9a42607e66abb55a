"""The event log is append-only with one event per (task, seq) (apps/events/models.py; DESIGN.md §4;
spec table 16.2: order is seq, never timestamps)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.events.models import TaskEvent
from apps.tasks.services import task_submit
from tests.conftest import p


def test_a_second_event_with_the_same_seq_is_refused_by_the_database(requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Printer shows 50.4 fuser error").task
    first = TaskEvent.objects.get(task=task)
    assert (first.seq, first.type) == (1, "task.accepted")
    with pytest.raises(IntegrityError), transaction.atomic():
        TaskEvent.objects.create(task=task, tenant_id=task.tenant_id, seq=1, type="retrieval.started", payload={},
                                 payload_digest="0" * 64, occurred_at=timezone.now(), actor="test")
    assert list(TaskEvent.objects.filter(task=task).values_list("seq", "type")) == [(1, "task.accepted")]


def test_events_read_in_seq_order_whatever_their_clock(requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="UPS on battery alarm").task
    earlier = timezone.now() - timedelta(days=1)
    TaskEvent.objects.create(task=task, tenant_id=task.tenant_id, seq=2, type="retrieval.started", payload={},
                             payload_digest="0" * 64, occurred_at=earlier, actor="test")
    assert [e.seq for e in TaskEvent.objects.filter(task=task)] == [1, 2]
