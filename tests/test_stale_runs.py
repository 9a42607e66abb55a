"""A worker whose run's transaction is ended under it (it stalled past
``idle_in_transaction_session_timeout``, a failover, ``pg_terminate_backend``) wakes with nothing of
that transaction committed. It must never write what it had not committed, never commit under a
lease that passed on, and never give back a lease another worker now holds: its fencing token was
given out once, by a claim that committed on its own (DESIGN.md §5; docs/architecture.md §4)."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from django.db import connection, transaction

import apps.agent.context as context_mod
import apps.agent.reads as reads_mod
from apps.agent.runner import AGENT, TOOLS, agent_run
from apps.events.models import RefusedEvent, TaskEvent
from apps.tasks import reducer
from apps.tasks.leases import task_claim, task_release
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.runs import RunTransaction
from apps.tasks.services import task_submit
from apps.tasks.store import task_append_event
from tests.conftest import p

pytestmark = pytest.mark.django_db(transaction=True)


def _other_session() -> psycopg.Connection:
    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    return psycopg.connect(**params, autocommit=True)


def _end_this_session_and_expire_its_lease(task_id) -> None:
    """What a long stall inside a run's transaction comes to: PostgreSQL ends the worker's session
    (its transaction rolls back) and the worker's lease expires, so another worker may claim."""
    pid = connection.connection.info.backend_pid
    with _other_session() as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
        while other.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
            time.sleep(0.02)
        other.execute("UPDATE tasks_task SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
                      [task_id])


def _in_thread(fn):
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc
        finally:
            connection.close()

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wakes(run) -> None:
    """Worker A's run, going on after its session was ended: it ends with the session's error, or
    quietly once its next write is refused for the lost lease (recorded) — either is fine here."""
    try:
        run()
    except Exception:  # noqa: BLE001, S110 - what matters is what it did or did not write
        pass


def _row(task_id):
    with _other_session() as other:
        return other.execute("SELECT version, status, lease_generation, lease_owner FROM tasks_task WHERE id = %s",
                             [task_id]).fetchone()


def _b_runs_while_a_reserves(real_reserve, task: Task, seen: dict):
    """A ``budget_reserve`` for worker A (the main thread): the first time A reserves (inserted, not
    committed), its session is ended and its lease expired, worker B runs the task in a thread to
    its next wait, and B's row is kept in ``seen["after_b"]`` (A's fencing token in
    ``seen["a_token"]``); every other reserve is the real one."""

    def reserve_then_stall(**kwargs):
        out = real_reserve(**kwargs)
        if threading.current_thread() is threading.main_thread() and "a_token" not in seen:
            seen["a_token"] = kwargs["lease_generation"]
            _end_this_session_and_expire_its_lease(task.pk)
            t, out_b = _in_thread(lambda: agent_run(task_id=task.pk, pool=AGENT))  # worker B
            t.join()
            assert "error" not in out_b, out_b
            seen["after_b"] = _row(task.pk)
        return out

    return reserve_then_stall


def _retrieving(requester, device) -> Task:
    """A task in RETRIEVING with no lease (its reads still to be done)."""
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task
    lease = task_claim(task_id=task.pk)
    with RunTransaction():
        task_append_event(task=Task.objects.get(pk=task.pk), event_type="retrieval.started", payload={},
                          actor="worker:setup", lease_generation=lease.generation)
        task_release(lease=lease)
    return Task.objects.get(pk=task.pk)


def test_a_worker_whose_transaction_was_ended_writes_nothing_it_had_not_committed(requester, device, monkeypatch):
    """A's run reserves its reads (not committed yet), then its session is ended; B claims (a new
    fencing token), sees RETRIEVING, hands the task to the tools pool. A wakes: nothing of its
    rolled-back transaction reaches the task row, its settlement is refused and recorded, and the
    log and the row stay replay-equal, with no gap in the sequence."""
    monkeypatch.setattr(reducer, "CURRENT", reducer.v5.VERSION)
    task = _retrieving(requester, device)
    seen = {}
    monkeypatch.setattr(context_mod, "budget_reserve", _b_runs_while_a_reserves(context_mod.budget_reserve, task, seen))
    _wakes(lambda: agent_run(task_id=task.pk, pool=TOOLS))  # worker A wakes up here
    assert seen["after_b"][2] == seen["a_token"] + 1, "B got a fencing token of its own"
    row = Task.objects.get(pk=task.pk)
    events = list(TaskEvent.objects.filter(task=row).order_by("seq").values_list("seq", flat=True))
    assert events == list(range(1, row.version + 1)), "no gap in the sequence"
    assert (row.version, row.status) == (2, "RETRIEVING") and row.state["reservations"] == {}
    assert task_replay(row, use_snapshot=False).ok
    # A's settlement of its reads is refused and recorded: the reservation it settles was never
    # committed (and its lease has passed on)
    assert RefusedEvent.objects.filter(task=row, type="budget.settled").exists()


def test_a_worker_whose_transaction_was_ended_does_not_give_back_the_next_workers_lease(requester, device,
                                                                                        monkeypatch):
    monkeypatch.setattr(reducer, "CURRENT", reducer.v5.VERSION)
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task
    real_reserve, real_read = context_mod.budget_reserve, context_mod._read
    b_in_activity, b_may_go, seen = threading.Event(), threading.Event(), {}

    def read(task_, reads, timeout):
        if threading.current_thread().name != "MainThread":  # worker B's reads take a while
            b_in_activity.set()
            b_may_go.wait(30)
        return real_read(task_, reads, timeout)

    def reserve_then_stall(**kwargs):
        out = real_reserve(**kwargs)
        if threading.current_thread().name == "MainThread":  # worker A
            seen["a_token"] = kwargs["lease_generation"]
            _end_this_session_and_expire_its_lease(task.pk)
            seen["b"] = _in_thread(lambda: agent_run(task_id=task.pk, pool=TOOLS))  # worker B
            assert b_in_activity.wait(30)
            seen["b_holds"] = _row(task.pk)
        return out

    monkeypatch.setattr(context_mod, "budget_reserve", reserve_then_stall)
    monkeypatch.setattr(context_mod, "_read", read)
    _wakes(lambda: agent_run(task_id=task.pk, pool=TOOLS))  # worker A wakes up
    _b_kept_its_lease(task, seen, b_may_go)


def test_a_reducer6_worker_whose_transaction_was_ended_writes_nothing_it_had_not_committed(requester, device,
                                                                                           monkeypatch):
    """reducer/6: A's run activates the plan and reserves its first read (not committed yet), then its
    session is ended; B claims (a new fencing token) and dispatches the reads itself. A wakes: nothing
    of its rolled-back transaction reaches the task row, and the log and the row stay replay-equal,
    with no gap in the sequence and every event after retrieval.started B's."""
    task = _retrieving(requester, device)
    assert task.artifact_bundle["reducer"] == "reducer/6"
    seen = {}
    monkeypatch.setattr(reads_mod, "budget_reserve", _b_runs_while_a_reserves(reads_mod.budget_reserve, task, seen))
    _wakes(lambda: agent_run(task_id=task.pk, pool=AGENT))  # worker A wakes up here
    assert seen["after_b"][2] == seen["a_token"] + 1, "B got a fencing token of its own"
    row = Task.objects.get(pk=task.pk)
    assert (row.version, row.status) == seen["after_b"][:2], "A wrote nothing after B"
    events = list(TaskEvent.objects.filter(task=row).order_by("seq").values_list("seq", "type", "lease_generation"))
    assert [e[0] for e in events] == list(range(1, row.version + 1)), "no gap in the sequence"
    assert [e[1] for e in events[:3]] == ["task.accepted", "retrieval.started", "plan.activated"]
    assert all(gen == seen["a_token"] + 1 for _, _, gen in events[2:]), events
    # B's reads: the local two joined, the ticket read still reserved (its activity not run here)
    [ticket] = [aid for aid, a in row.state["activities"].items() if a["step"] == "ticket"]
    assert row.status == "RETRIEVING" and set(row.state["reservations"]) == {ticket}
    assert {e[1] for e in events[6:]} == {"device.read", "evidence.retrieved"}
    assert task_replay(row, use_snapshot=False).ok


def test_a_reducer6_worker_whose_transaction_was_ended_does_not_give_back_the_next_workers_lease(
        requester, device, monkeypatch):
    """reducer/6: as above, with B still doing its local reads (holding its lease) when A wakes: A's
    end of run must not release B's lease, and no third worker takes the task meanwhile."""
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task
    assert task.artifact_bundle["reducer"] == "reducer/6"
    real_reserve, real_read = reads_mod.budget_reserve, reads_mod.read_perform
    b_in_activity, b_may_go, seen = threading.Event(), threading.Event(), {}

    def read(task_, activity, *, timeout):
        if threading.current_thread() is not threading.main_thread():  # worker B's reads take a while
            b_in_activity.set()
            b_may_go.wait(30)
        return real_read(task_, activity, timeout=timeout)

    def reserve_then_stall(**kwargs):
        out = real_reserve(**kwargs)
        if threading.current_thread() is threading.main_thread() and "a_token" not in seen:  # worker A
            seen["a_token"] = kwargs["lease_generation"]
            _end_this_session_and_expire_its_lease(task.pk)
            seen["b"] = _in_thread(lambda: agent_run(task_id=task.pk, pool=AGENT))  # worker B
            assert b_in_activity.wait(30)
            seen["b_holds"] = _row(task.pk)
        return out

    monkeypatch.setattr(reads_mod, "budget_reserve", reserve_then_stall)
    monkeypatch.setattr(reads_mod, "read_perform", read)
    _wakes(lambda: agent_run(task_id=task.pk, pool=AGENT))  # worker A wakes up
    _b_kept_its_lease(task, seen, b_may_go)


def test_a_row_image_is_written_before_a_savepoint_that_then_rolls_back(requester, device):
    """Inside a run, an event leaves the row's new image to be written later; a savepoint opened
    after it (and rolled back) must not take that write with it."""
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task
    lease = task_claim(task_id=task.pk)
    with RunTransaction():
        task = task_append_event(task=Task.objects.get(pk=task.pk), event_type="retrieval.started", payload={},
                                 actor="worker:test", lease_generation=lease.generation)
        task = task_append_event(task=task, event_type="budget.reserved", actor="worker:test",
                                 lease_generation=lease.generation,
                                 payload={"reservation_id": "r1", "activity": "a", "amounts": {"tool_calls": 1},
                                          "generation": lease.generation})
        with pytest.raises(ValueError), transaction.atomic():
            Task.objects.filter(pk=task.pk).exists()
            raise ValueError("the savepoint rolls back")
        task_release(lease=lease)
    row = Task.objects.get(pk=task.pk)
    assert row.version == 3 and row.state["limits"]["tool_calls"]["reserved"] == 1
    assert task_replay(row, use_snapshot=False).ok


def _b_kept_its_lease(task, seen: dict, b_may_go: threading.Event) -> None:
    """Worker A has ended its run while worker B (``seen["b"]``: its thread and outcome) is in its
    reads: B still holds the lease A's end did not give back, no third worker can take the task,
    and once B is let go it finishes without error and the task replays."""
    during_b = _row(task.pk)
    third = task_claim(task_id=task.pk, owner="host:worker-C")
    b_may_go.set()
    thread, out_b = seen["b"]
    thread.join(30)
    assert "error" not in out_b, out_b
    assert seen["b_holds"][2] == seen["a_token"] + 1, "B got a fencing token of its own"
    assert during_b[3] is not None and during_b[2] == seen["a_token"] + 1, "B still holds its lease"
    assert third is None, "no third worker takes the task while B works on it"
    row = Task.objects.get(pk=task.pk)
    assert task_replay(row, use_snapshot=False).ok
