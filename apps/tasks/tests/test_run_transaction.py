"""A run's events committed at its checkpoints (``RunTransaction``, ``checkpoint``; DESIGN.md §4,
§5): what one commit holds is all there or none of it is, an activity runs outside any
transaction after what it consumes is durable, refusals leave nothing half-written, and the task
row — written once per commit while the run holds it — is what every reader sees and what replay
gives."""

from __future__ import annotations

import contextlib

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from apps.events.models import RefusedEvent, TaskEvent
from apps.tasks import reducer
from apps.tasks.budget import budget_reserve
from apps.tasks.leases import task_claim, task_release
from apps.tasks.models import Task, TenantUsage
from apps.tasks.replay import task_replay
from apps.tasks.runs import RunTransaction, checkpoint
from apps.tasks.services import task_submit
from apps.tasks.store import StaleWrite, task_append_event
from apps.tasks.usage import BudgetExceeded
from tests.conftest import p

pytestmark = pytest.mark.django_db(transaction=True)


def _other_session() -> psycopg.Connection:
    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    return psycopg.connect(**params, autocommit=True)


def _seen_elsewhere(task_id) -> tuple[int, int]:
    """``(row version, events)`` of the task as another session sees it (what is committed)."""
    with _other_session() as other:
        version = other.execute("SELECT version FROM tasks_task WHERE id = %s", [task_id]).fetchone()[0]
        events = other.execute("SELECT count(*) FROM events_taskevent WHERE task_id = %s", [task_id]).fetchone()[0]
    return version, events


def _lease_elsewhere(task_id):
    """``(lease_owner, lease_generation)`` of the task as another session sees it."""
    with _other_session() as other:
        return other.execute("SELECT lease_owner, lease_generation FROM tasks_task WHERE id = %s",
                             [task_id]).fetchone()


@pytest.fixture
def accepted(requester, device):
    return task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task


def _append(task, lease, event_type, payload=None, **kwargs):
    return task_append_event(task=task, event_type=event_type, payload=payload or {}, actor="worker:test",
                             lease_generation=lease.generation, **kwargs)


@contextlib.contextmanager
def _started(accepted):
    """A run of ``accepted``: the lease claimed (committed alone, as the runner does), then the run's
    transaction with its first event, ``retrieval.started``. Yields ``(lease, task)``."""
    lease = task_claim(task_id=accepted.pk)
    with RunTransaction():
        yield lease, _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")


def test_a_runs_events_commit_together_at_its_end_and_replay(accepted):
    with _started(accepted) as (lease, task):
        task, _ = budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 3},
                                 actor="worker:test", lease_generation=lease.generation, task=task)
        assert _seen_elsewhere(accepted.pk) == (1, 1), "nothing of the run is visible before its commit"
        task_release(lease=lease)
    assert _seen_elsewhere(accepted.pk) == (3, 3)
    row = Task.objects.get(pk=accepted.pk)
    assert row.status == reducer.RETRIEVING and row.lease_owner is None
    assert row.state["limits"]["tool_calls"]["reserved"] == 3
    assert task_replay(row).ok


def test_a_held_row_is_written_once_per_commit_and_read_as_it_stands(accepted):
    """The run's first event locks the row under the CAS's conditions and writes nothing; the next
    events need no statement; a read of the task table inside the run first writes the events (one
    ``INSERT``) and the row's image (one ``UPDATE``), so it sees the row as the events left it."""
    lease = task_claim(task_id=accepted.pk)
    with RunTransaction():
        task = Task.objects.get(pk=accepted.pk)
        with CaptureQueriesContext(connection) as queries:
            task = _append(task, lease, "retrieval.started")
            task, _ = budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 3},
                                     actor="worker:test", lease_generation=lease.generation, task=task)
            task, _ = budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 1},
                                     actor="worker:test", lease_generation=lease.generation, task=task)
        # (the tests snapshot every fourth event: version 4's snapshot is its own insert)
        statements = [q["sql"].lstrip() for q in queries if "tasksnapshot" not in q["sql"]]
        assert len(statements) == 1 and "FOR NO KEY UPDATE" in statements[0], \
            "one lock for the first event, no write and no statement for the next ones"
        # a reader in the same transaction sees the row as it stands (written before the read)
        with CaptureQueriesContext(connection) as queries:
            assert Task.objects.values_list("version", "status").get(pk=accepted.pk) == (4, reducer.RETRIEVING)
        inserted, updated, read = (q["sql"].lstrip() for q in queries)
        assert inserted.startswith("INSERT INTO events_taskevent") and inserted.count("::jsonb") == 3
        assert updated.startswith("UPDATE tasks_task") and read.startswith("SELECT")
        task_release(lease=lease)
    row = Task.objects.get(pk=accepted.pk)
    assert row.version == 4 and row.state["limits"]["tool_calls"]["reserved"] == 4
    assert list(TaskEvent.objects.filter(task_id=accepted.pk).values_list("seq", flat=True)) == [1, 2, 3, 4]
    assert task_replay(row).ok


def test_a_read_of_the_events_inside_the_run_sees_the_runs_events(accepted):
    with _started(accepted) as (lease, task):
        budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 2}, actor="worker:test",
                       lease_generation=lease.generation, task=task)
        assert list(TaskEvent.objects.filter(task_id=accepted.pk).order_by("seq").values_list("type", flat=True)) \
            == ["task.accepted", "retrieval.started", "budget.reserved"]
        task_release(lease=lease)
    assert _seen_elsewhere(accepted.pk) == (3, 3)


def test_the_release_goes_with_the_rows_last_image_and_only_at_the_commit(accepted):
    with _started(accepted) as (lease, task):
        with CaptureQueriesContext(connection) as queries:
            assert task_release(lease=lease) is True
        assert queries.captured_queries == [], "no statement of its own while the run holds the row"
        assert _lease_elsewhere(accepted.pk) == (lease.owner, lease.generation), "not released before the commit"
    assert _seen_elsewhere(accepted.pk) == (2, 2)
    assert _lease_elsewhere(accepted.pk) == (None, lease.generation)


def test_a_renewal_goes_with_the_rows_next_image_or_alone_when_the_run_holds_nothing(accepted):
    from apps.tasks.leases import task_lease_renew

    lease = task_claim(task_id=accepted.pk)
    before = Task.objects.values_list("lease_expires_at", flat=True).get(pk=accepted.pk)
    with RunTransaction():
        task_lease_renew(lease=lease, seconds=600)  # nothing held yet: written at once (in the transaction)
        renewed = Task.objects.values_list("lease_expires_at", flat=True).get(pk=accepted.pk)
        assert renewed > before
        _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")
        with CaptureQueriesContext(connection) as queries:
            task_lease_renew(lease=lease, seconds=1200)
        assert queries.captured_queries == []
        with checkpoint():
            # committed with the row's image, before the activity
            expires = Task.objects.values_list("lease_expires_at", flat=True).get(pk=accepted.pk)
            assert (expires - renewed).total_seconds() > 500
        task_release(lease=lease)
    assert _lease_elsewhere(accepted.pk) == (None, lease.generation)


def test_a_run_whose_lease_passed_on_writes_nothing_at_its_first_event(accepted):
    lease = task_claim(task_id=accepted.pk)
    Task.objects.filter(pk=accepted.pk).update(lease_generation=lease.generation + 1)  # another worker's claim
    with pytest.raises(StaleWrite), RunTransaction():
        _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")
    assert _seen_elsewhere(accepted.pk) == (1, 1)
    assert RefusedEvent.objects.filter(task_id=accepted.pk, type="retrieval.started").exists()


def test_a_checkpoint_commits_what_was_recorded_and_runs_its_block_outside_any_transaction(accepted):
    with _started(accepted) as (lease, task):
        with checkpoint():
            assert not connection.in_atomic_block, "an activity runs outside any transaction"
            assert _seen_elsewhere(accepted.pk) == (2, 2), "what it consumes is durable before it starts"
            lease_row = Task.objects.values_list("lease_owner", flat=True).get(pk=accepted.pk)
            assert lease_row == lease.owner, "the lease claim is committed (on its own, before the run)"
        task, _ = budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 3},
                                 actor="worker:test", lease_generation=lease.generation)
        assert _seen_elsewhere(accepted.pk) == (2, 2)
        task_release(lease=lease)
    assert _seen_elsewhere(accepted.pk) == (3, 3)


def test_a_transaction_that_cannot_commit_loses_only_what_followed_the_last_checkpoint(accepted):
    """A statement that fails outside a savepoint leaves the transaction unable to commit, like a
    crash before the commit: the run keeps what its last checkpoint committed, nothing after."""
    lease = task_claim(task_id=accepted.pk)
    with pytest.raises(Exception, match="division by zero"), RunTransaction():
        task = _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")
        with checkpoint():
            pass
        budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 3}, actor="worker:test",
                       lease_generation=lease.generation)
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")
    assert _seen_elsewhere(accepted.pk) == (2, 2)
    assert task_replay(Task.objects.get(pk=accepted.pk)).ok


def test_an_exception_that_leaves_the_transaction_usable_keeps_what_was_recorded(accepted):
    lease = task_claim(task_id=accepted.pk)
    with pytest.raises(RuntimeError, match="after the events"), RunTransaction():
        _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")
        raise RuntimeError("raised after the events")
    assert _seen_elsewhere(accepted.pk) == (2, 2)
    assert Task.objects.get(pk=accepted.pk).status == reducer.RETRIEVING


def test_a_side_effect_that_fails_after_its_event_was_written_rolls_the_commit_back_whole(accepted):
    def fails(task, event):
        raise ValueError("the side effect failed")

    lease = task_claim(task_id=accepted.pk)
    with pytest.raises(ValueError), RunTransaction():
        task = _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")
        _append(task, lease, "budget.reserved", {"reservation_id": "r1", "activity": "a",
                                                 "amounts": {"tool_calls": 1}, "generation": lease.generation},
                side_effects=fails)
    assert _seen_elsewhere(accepted.pk) == (1, 1), "the whole commit rolled back"
    row = Task.objects.get(pk=accepted.pk)
    assert row.status == reducer.ACCEPTED and row.lease_generation == lease.generation == 1


def test_a_refusal_inside_a_run_writes_nothing_of_the_event_and_the_run_goes_on(accepted, tenant):
    tenant.daily_budget_units = 10
    tenant.save()

    def day_rows():
        """The tenant's money used and reserved today (an all-zero day row counts as none)."""
        rows = TenantUsage.objects.filter(tenant=tenant).values_list("money_used", "money_reserved")
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    with _started(accepted) as (lease, task):
        before = day_rows()
        with pytest.raises(BudgetExceeded) as refused:  # the tenant's quota: 10 units a day
            budget_reserve(task_id=task.pk, activity="a", amounts={"money": 50}, actor="worker:test",
                           lease_generation=lease.generation, task=task)
        assert refused.value.scope == "tenant" and day_rows() == before
        with pytest.raises(reducer.IllegalTransition):  # δ refuses it: recorded, not applied
            _append(task, lease, "receipt.recorded", {"action_id": "x", "receipt": {}})
        task = _append(task, lease, "task.failed", {"reason": "quota"})  # the run goes on
        task_release(lease=lease)
    assert day_rows() == before
    row = Task.objects.get(pk=accepted.pk)
    assert [e.type for e in TaskEvent.objects.filter(task=row).order_by("seq")] == \
        ["task.accepted", "retrieval.started", "task.failed"]
    assert row.status == reducer.FAILED and row.budget_reserved == 0
    assert RefusedEvent.objects.filter(task=row, type="receipt.recorded").exists()
    assert task_replay(row).ok


def test_a_lost_lease_is_refused_at_the_first_write_after_a_checkpoint(accepted):
    with _started(accepted) as (lease, task):
        with checkpoint():
            # the lease passes to another worker while this one reads
            Task.objects.filter(pk=accepted.pk).update(lease_expires_at=None, lease_owner=None)
            other = task_claim(task_id=accepted.pk)
            assert other.generation == lease.generation + 1
        with pytest.raises(StaleWrite):
            budget_reserve(task_id=task.pk, activity="context_read", amounts={"tool_calls": 3},
                           actor="worker:test", lease_generation=lease.generation, task=task)
    refused = RefusedEvent.objects.get(task_id=accepted.pk, type="budget.reserved")
    assert "lease lost" in refused.reason
    assert _seen_elsewhere(accepted.pk) == (2, 2)


def test_a_checkpoint_inside_a_nested_transaction_is_refused_and_runs_are_not_nested(accepted):
    with RunTransaction():
        with pytest.raises(transaction.TransactionManagementError), transaction.atomic(), checkpoint():
            pass
        with pytest.raises(RuntimeError, match="already open"), RunTransaction():
            pass


def test_a_runs_ledger_moves_reach_the_tenants_day_row_once_at_its_commit(accepted, tenant):
    """Several ledger events of one commit move the tenant's day row once, by their sum, at the
    commit: until then the run holds no lock on it, so other runs of the tenant do not wait."""
    with _started(accepted) as (lease, task):
        with CaptureQueriesContext(connection) as queries:
            task, first = budget_reserve(task_id=task.pk, activity="a", amounts={"money": 5}, actor="worker:test",
                                         lease_generation=lease.generation, task=task)
            task, _ = budget_reserve(task_id=task.pk, activity="b", amounts={"money": 7}, actor="worker:test",
                                     lease_generation=lease.generation, task=task)
        assert not [q for q in queries if "tasks_tenantusage" in q["sql"] and "UPDATE" in q["sql"]]
        with _other_session() as other:  # the day row is not locked by the run
            other.execute("SELECT 1 FROM tasks_tenantusage WHERE tenant_id = %s FOR UPDATE NOWAIT", [tenant.pk])
        task_release(lease=lease)
    [row] = TenantUsage.objects.filter(tenant=tenant)
    assert (row.money_used, row.money_reserved) == (0, 12)
    assert Task.objects.get(pk=accepted.pk).budget_reserved == 12


def test_a_run_whose_admitted_reservation_no_longer_fits_at_its_commit_rolls_back_whole(accepted, tenant,
                                                                                          requester, device):
    """Two transactions admit reservations against the same room; the one that commits second
    finds it gone, and rolls back whole (its next attempt is refused with the reason)."""
    from apps.tasks.usage import TenantQuotaRace

    tenant.daily_budget_units = 10
    tenant.save()
    lease = task_claim(task_id=accepted.pk)
    with pytest.raises(TenantQuotaRace), RunTransaction():
        task = _append(Task.objects.get(pk=accepted.pk), lease, "retrieval.started")
        budget_reserve(task_id=task.pk, activity="a", amounts={"money": 8}, actor="worker:test",
                       lease_generation=lease.generation, task=task)  # admitted: 10 left as read
        with _other_session() as other:  # meanwhile another task of the tenant takes 5 of the 10
            other.execute("INSERT INTO tasks_tenantusage (tenant_id, day, money_used, money_reserved, tokens_used, "
                          "tokens_reserved, updated_at) VALUES (%s, (now() at time zone 'utc')::date, 0, 5, 0, 0, "
                          "now()) ON CONFLICT (tenant_id, day) DO UPDATE SET money_reserved = 5", [tenant.pk])
    row = Task.objects.get(pk=accepted.pk)
    assert (row.version, row.status) == (1, reducer.ACCEPTED)
    assert list(TenantUsage.objects.filter(tenant=tenant).values_list("money_reserved", flat=True)) == [5]
    assert task_replay(row).ok


def test_an_event_written_inside_a_nested_transaction_of_a_run_keeps_the_row_in_step(accepted):
    """A write the run makes inside a savepoint of its own (a nested ``atomic``) is not part of what
    the run vouches for: the row is written up to date before it and read again after it."""
    with _started(accepted) as (lease, task):
        with transaction.atomic():
            task, _ = budget_reserve(task_id=task.pk, activity="a", amounts={"tool_calls": 1},
                                     actor="worker:test", lease_generation=lease.generation)
        task, _ = budget_reserve(task_id=task.pk, activity="b", amounts={"tool_calls": 1},
                                 actor="worker:test", lease_generation=lease.generation, task=task)
        task_release(lease=lease)
    row = Task.objects.get(pk=accepted.pk)
    assert row.version == 4 and row.state["limits"]["tool_calls"]["reserved"] == 2
    assert task_replay(row).ok


def test_a_release_inside_a_savepoint_that_rolls_back_is_rolled_back_with_it(accepted):
    with _started(accepted) as (lease, task):
        with pytest.raises(RuntimeError), transaction.atomic():
            assert task_release(lease=lease) is True
            raise RuntimeError("the savepoint rolls back")
    assert _seen_elsewhere(accepted.pk) == (2, 2)
    assert _lease_elsewhere(accepted.pk) == (lease.owner, lease.generation), "the release went with the savepoint"


def test_a_run_holds_a_row_it_read_locked_only_under_the_token_the_row_carries(accepted):
    """``hold_read``: a row the run locked and read whole is held (its next event needs no lock
    statement) only when it carries the run's fencing token; under another, nothing is held."""
    lease = task_claim(task_id=accepted.pk)
    with RunTransaction() as run:
        task = Task.objects.select_for_update(no_key=True).get(pk=accepted.pk)
        with pytest.raises(ValueError):
            run.hold_read(task, generation=lease.generation + 1)
        assert run.held(task.pk, lease.generation + 1) is None
        run.hold_read(task, generation=lease.generation)
        assert run.current(task.pk, lease.generation) is task
        with CaptureQueriesContext(connection) as queries:
            _append(task, lease, "retrieval.started")
        assert queries.captured_queries == [], "held: no lock statement, the event is written at the commit"
        task_release(lease=lease)
    assert _seen_elsewhere(accepted.pk) == (2, 2)
