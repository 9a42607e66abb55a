"""Appending one event to each of several tasks in one transaction (``task_events_prepare`` /
``task_events_commit``, DESIGN.md §4): the same CAS, seq, ledger and replay guarantees as one
event at a time, all or nothing."""

from __future__ import annotations

import copy
import re
from datetime import UTC

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.batch import task_events_commit, task_events_prepare
from apps.tasks.models import Task, TenantUsage
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from apps.tasks.store import StaleWrite, task_append_with_retry
from apps.tasks.usage import BudgetExceeded, tenant_ledger_apply_many
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


def _reserving(task, money: int, tokens: int) -> dict:
    new = copy.deepcopy(task.state)
    new["budget"]["reserved"] += money
    new.setdefault("limits", {}).setdefault("tokens", {"used": 0, "reserved": 0})
    new["limits"]["tokens"] = {**new["limits"]["tokens"],
                               "reserved": new["limits"]["tokens"].get("reserved", 0) + tokens}
    return new


def _day_row(tenant):
    return TenantUsage.objects.for_tenant(tenant.pk).get(day=timezone.now().astimezone(UTC).date())


def test_a_batch_moves_the_tenants_day_row_once_by_the_sum_of_its_events(three_tasks, tenant):
    assert all("limits" in t.state for t in three_tasks)
    TenantUsage.objects.bulk_create([TenantUsage(tenant=tenant, day=timezone.now().astimezone(UTC).date())],
                                    ignore_conflicts=True)
    before = _day_row(tenant)
    changes = [(t, t.state, _reserving(t, money=3 + i, tokens=100 * (i + 1))) for i, t in enumerate(three_tasks)]
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        tenant_ledger_apply_many(changes)
    moves = [q for q in queries.captured_queries if re.match(r'\s*UPDATE "?tasks_tenantusage', q["sql"])]
    assert len(moves) == 1
    after = _day_row(tenant)
    assert after.money_reserved - before.money_reserved == 3 + 4 + 5
    assert after.tokens_reserved - before.tokens_reserved == 100 + 200 + 300
    assert (after.money_used, after.tokens_used) == (before.money_used, before.tokens_used)


def test_a_batch_past_the_quota_only_as_a_whole_is_refused_and_moves_nothing(three_tasks, tenant):
    quota = tenant.quota()["money"]
    TenantUsage.objects.bulk_create([TenantUsage(tenant=tenant, day=timezone.now().astimezone(UTC).date())],
                                    ignore_conflicts=True)
    before = _day_row(tenant)
    left = quota - before.money_used - before.money_reserved
    each = left // 2 + 1  # any one of them fits, two together do not
    changes = [(t, t.state, _reserving(t, money=each, tokens=0)) for t in three_tasks[:2]]
    with pytest.raises(BudgetExceeded), transaction.atomic():
        tenant_ledger_apply_many(changes)
    after = _day_row(tenant)
    assert (after.money_reserved, after.money_used) == (before.money_reserved, before.money_used)
    with transaction.atomic():
        tenant_ledger_apply_many(changes[:1])
    assert _day_row(tenant).money_reserved == before.money_reserved + each
