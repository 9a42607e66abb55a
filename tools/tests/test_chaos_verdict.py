"""The chaos run's verdict on its long faults (tools/chaos/run.py): a run is not OK when a planned
fault never took effect (skipped, refused, its target gone, PostgreSQL never stopped) or when the
stack did not recover from one within its limit — only when each planned fault was taken and
recovered (or had nothing to recover)."""

from __future__ import annotations

import subprocess
import threading

import psycopg
import pytest

from tools.chaos import faults
from tools.chaos.run import Chaos, long_fault_problems

PLAN = [("pause", "worker-agent-1"), ("pause", "worker-outbox-1"), ("partition", "helpdesk"),
        ("partition", "reference"), ("postgres_restart", "postgresql")]


def _record(kind, target, **kw):
    record = faults.FaultRecord(kind, target, 100.0, ended=120.0, recovery_seconds=3.0)
    for name, value in kw.items():
        setattr(record, name, value)
    return record


def _all_taken():
    return [_record(kind, target) for kind, target in PLAN]


def test_a_run_that_took_and_recovered_from_every_planned_fault_has_nothing_to_report():
    assert long_fault_problems(_all_taken(), PLAN) == []


def test_a_planned_fault_never_taken_fails_the_run_though_its_kind_was_taken_on_another_target():
    records = [r for r in _all_taken() if (r.kind, r.target) != ("pause", "worker-outbox-1")]
    assert long_fault_problems(records, PLAN) == ["pause worker-outbox-1 was never taken"]
    records = [r for r in _all_taken() if (r.kind, r.target) != ("partition", "helpdesk")]
    assert long_fault_problems(records, PLAN) == ["partition helpdesk was never taken"]


def test_a_fault_the_stack_did_not_recover_from_fails_the_run():
    records = _all_taken() + [_record("partition", "reference", recovery_seconds=None,
                                      failure="no receipt within 180 s of the heal (4 tasks not finished)")]
    assert long_fault_problems(records, PLAN) == [
        "partition reference: no receipt within 180 s of the heal (4 tasks not finished)"]


def test_a_fault_that_did_not_take_effect_does_not_count_as_taken():
    records = [r for r in _all_taken() if r.kind != "postgres_restart"] + [
        _record("postgres_restart", "postgresql", taken=False, failure="pg_ctl stop failed: no server")]
    assert long_fault_problems(records, PLAN) == ["postgres_restart postgresql: pg_ctl stop failed: no server",
                                                  "postgres_restart postgresql was never taken"]


def test_a_postgresql_that_would_not_stop_is_a_failed_fault(monkeypatch):
    """pg_ctl stop refusing (wrong data directory, no permission…) left the server up: the record says
    so instead of reporting a restart and a recovery time."""
    calls = []

    def pg_ctl(pgdata, *args):
        calls.append(args)
        return subprocess.CompletedProcess(["pg_ctl", *args], 1, stdout="", stderr="pg_ctl: no server running")

    monkeypatch.setattr(faults, "pg_ctl", pg_ctl)
    monkeypatch.setattr(faults, "query", lambda url, sql, params=(): [(3,)])
    monkeypatch.setattr(faults.time, "sleep", lambda s: None)
    record = faults.postgres_restart("/nonexistent", "/nonexistent/log", 5.0, "postgres://x/y", "http://127.0.0.1:1",
                                     limit=1.0)
    assert not record.taken and "pg_ctl stop failed" in record.failure and record.recovery_seconds is None
    assert all(args[-1] != "restart" for args in calls)  # nothing to start again


def test_a_postgresql_that_still_answers_after_the_stop_is_a_failed_fault(monkeypatch):
    monkeypatch.setattr(faults, "pg_ctl", lambda pgdata, *args: subprocess.CompletedProcess(args, 0, "", ""))
    monkeypatch.setattr(faults, "query", lambda url, sql, params=(): [(3,)])  # it answers all along
    monkeypatch.setattr(faults.time, "sleep", lambda s: None)
    record = faults.postgres_restart("/nonexistent", "/nonexistent/log", 5.0, "postgres://x/y", "http://127.0.0.1:1",
                                     limit=1.0)
    assert not record.taken and "still answered" in record.failure


def test_a_pause_whose_process_was_gone_is_not_taken():
    proc = subprocess.Popen(["true"], start_new_session=True)  # noqa: S607
    proc.wait()
    record = faults.pause(proc, "worker-outbox-1", 1.0, 1.0, "postgres://unused/x", threading.Event(), tries=1)
    assert record is not None and not record.taken and record.note == "the process was gone"


class _Args:
    seed = 1


@pytest.mark.parametrize("outcome", ["skipped", "raised", "not_taken"])
def test_a_planned_fault_that_was_not_taken_is_tried_again_before_the_plan_counts_as_covered(monkeypatch, outcome):
    chaos = Chaos.__new__(Chaos)
    chaos.rng = __import__("random").Random(1)
    chaos.stop, chaos.long, chaos.lock, chaos.paused = threading.Event(), [], threading.Lock(), set()
    monkeypatch.setattr(chaos.stop, "wait", lambda timeout=None: chaos.stop.is_set())
    tries: list[tuple[str, str]] = []

    def take(kind, target):
        tries.append((kind, target))
        if len(tries) == 1:  # the first try of the first planned fault comes to nothing
            if outcome == "raised":
                raise psycopg.OperationalError("the server closed the connection")
            return None if outcome == "skipped" else _record(kind, target, taken=False, note="the process was gone")
        if len(tries) >= 6:
            chaos.stop.set()
        return _record(kind, target)

    chaos.take = take
    covered = threading.Event()
    plan = [("pause", "worker-outbox-1"), ("partition", "helpdesk")]
    chaos.long_fault_loop(plan, covered)
    assert tries[:3] == [plan[0], plan[1], plan[0]]  # tried again after the rest of the plan
    assert covered.is_set()
    assert long_fault_problems(chaos.long, plan) == []


def test_the_recovery_after_a_postgresql_restart_is_when_the_next_event_was_recorded(monkeypatch):
    """The next event came 0.5 s after the server was back; web's /healthz took 30 s to answer 200.
    The event's recovery time is 0.5 s, read from the event's own recorded_at — not the 30 s of
    the /healthz wait that happens to be measured first."""
    import types

    clock = {"now": 0.0}
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(
        time=lambda: 1000.0, monotonic=lambda: clock["now"], sleep=lambda s: None))
    monkeypatch.setattr(faults, "pg_ctl", lambda pgdata, *args: subprocess.CompletedProcess(args, 0, "", ""))
    stopped = {"yet": False}

    def query(url, sql, params=()):
        if "count(*)" in sql:
            return [(3,)]
        if sql == "SELECT 1":
            raise psycopg.OperationalError("connection refused")
        return [(1000.5,)] if "epoch" in sql else [(1,)]

    def wait_until(predicate, limit, step=0.5):
        assert predicate()
        took = 30.0 if not stopped["yet"] else 0.2  # the first wait is /healthz's
        stopped["yet"] = True
        clock["now"] += took
        return took

    monkeypatch.setattr(faults, "query", query)
    monkeypatch.setattr(faults, "wait_until", wait_until)
    monkeypatch.setattr(faults.httpx, "get", lambda *a, **k: types.SimpleNamespace(status_code=200))
    record = faults.postgres_restart("/nonexistent", "/nonexistent/log", 5.0, "postgres://x/y", "http://127.0.0.1:1")
    assert record.taken and not record.failure
    assert record.healthz_seconds == 30.0
    assert record.recovery_seconds == pytest.approx(0.5)


def test_a_partition_that_swallowed_no_request_reports_no_recovery_time(monkeypatch):
    """Tasks of the tenant were unfinished, but none of them sent anything during the partition: the
    next receipt after the heal measures nothing the partition did, so no recovery time is printed."""
    from tools.faultproxy import serve_in_thread

    proxy = serve_in_thread(0, "http://127.0.0.1:9")
    try:
        monkeypatch.setattr(faults, "query", lambda url, sql, params=(): [(3,)])  # 3 waiting; a receipt at once
        record = faults.partition(proxy.url, "helpdesk", 0.3, "postgres://x/y", "chaos-helpdesk", limit=1.0)
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert record.swallowed == 0 and record.recovery_seconds is None
    assert record.note == "it swallowed no request: nothing of the tenant's met it"
    assert "receipt" not in record.line()
