"""The budget ledger (DESIGN.md §8; spec §16.5; ADR 0013): admission only by an atomic reservation
``U + R + r ≤ B``, settlement ``U += c, R -= r`` with ``c ≤ r``, release of what is unused, separate
limits per dimension, per-tenant quotas on top — and all of it holding when many processes reserve
against one task at once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from django.db import connection
from hypothesis import given
from hypothesis import strategies as st

from apps.core.errors import QuotaExceeded
from apps.events.models import RefusedEvent, TaskEvent
from apps.tasks import reducer
from apps.tasks.budget import (
    activity_timeout,
    budget_release,
    budget_reserve,
    budget_settle,
    orphaned_reservations_settle,
)
from apps.tasks.models import Task, TenantUsage
from apps.tasks.reducer import v3 as reducer_v3
from apps.tasks.reducer.v3 import headroom
from apps.tasks.services import task_cancel, task_submit
from apps.tasks.store import task_append_event
from apps.tasks.usage import BudgetExceeded
from tests.conftest import p
from tests.procs import ROOT, database_url


def _running(requester, device, **limits) -> Task:
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Toner smear on every page").task
    assert task.artifact_bundle["reducer"] == "reducer/6"
    return task_append_event(task=task, event_type="retrieval.started", payload={}, actor="test")


def _money(task_id) -> tuple[int, int, int]:
    t = Task.objects.get(pk=task_id)
    return t.budget_total, t.budget_used, t.budget_reserved


def test_the_worked_example_of_design_section_8_exactly(requester, device):
    """B=100, U=40, R=20 → a 30 reservation is admitted (90), a further 20 is not; the first
    settles at 24 → U=64, R=20, 16 left."""
    task = _running(requester, device)
    assert task.budget_total == 100
    _, first = budget_reserve(task_id=task.pk, activity="a", amounts={"money": 40}, actor="test")
    budget_settle(task_id=task.pk, reservation_id=first.id, used={"money": 40}, actor="test")
    _, other = budget_reserve(task_id=task.pk, activity="b", amounts={"money": 20}, actor="test")
    assert _money(task.pk) == (100, 40, 20)

    _, thirty = budget_reserve(task_id=task.pk, activity="c", amounts={"money": 30}, actor="test")
    assert _money(task.pk) == (100, 40, 50)  # U + R = 90
    with pytest.raises(BudgetExceeded) as refused:
        budget_reserve(task_id=task.pk, activity="d", amounts={"money": 20}, actor="test")
    assert (refused.value.dimension, refused.value.requested, refused.value.available) == ("money", 20, 10)
    assert _money(task.pk) == (100, 40, 50), "a refused reservation writes nothing"

    task = budget_settle(task_id=task.pk, reservation_id=thirty.id, used={"money": 24}, actor="test")
    assert _money(task.pk) == (100, 64, 20)
    assert headroom(task.state)["money"] == 16
    assert set(task.state["reservations"]) == {other.id}
    # the tenant's day row moved by the same amounts
    row = TenantUsage.objects.get(tenant=task.tenant)
    assert (row.money_used, row.money_reserved) == (64, 20)


def test_cost_above_the_reservation_a_second_settlement_and_a_late_result_are_refused(requester, device):
    task = _running(requester, device)
    _, res = budget_reserve(task_id=task.pk, activity="model_call", amounts={"money": 5, "tokens": 900}, actor="t")
    with pytest.raises(reducer.IllegalTransition, match="tokens: cost 901 exceeds reservation 900"):
        budget_settle(task_id=task.pk, reservation_id=res.id, used={"tokens": 901}, actor="t")
    budget_settle(task_id=task.pk, reservation_id=res.id, used={"money": 3, "tokens": 700}, actor="t")
    with pytest.raises(reducer.IllegalTransition, match="no open reservation"):
        budget_settle(task_id=task.pk, reservation_id=res.id, used={"money": 1}, actor="t")
    reasons = list(RefusedEvent.objects.filter(task=task).values_list("reason", flat=True))
    assert len(reasons) == 2 and "c ≤ r" in reasons[0] and "late result" in reasons[1]
    t = Task.objects.get(pk=task.pk)
    assert (t.budget_used, t.budget_reserved) == (3, 0)
    assert t.state["limits"]["tokens"] == {"total": 60000, "used": 700, "reserved": 0}


def test_each_limit_is_its_own_dimension(requester, device, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "TASK_RETRY_LIMIT": 2, "TASK_TOOL_CALL_LIMIT": 3,
                          "TASK_TOKEN_LIMIT": 1000}
    task = _running(requester, device)
    for dim, amount, left in (("retries", 3, 2), ("tool_calls", 4, 3), ("tokens", 1001, 1000)):
        with pytest.raises(BudgetExceeded) as refused:
            budget_reserve(task_id=task.pk, activity="x", amounts={dim: amount}, actor="t")
        assert (refused.value.dimension, refused.value.available) == (dim, left)
        assert refused.value.reason.startswith(f"budget_exhausted: task {dim}")
    _, res = budget_reserve(task_id=task.pk, activity="x", amounts={"retries": 2, "tool_calls": 3, "tokens": 1000},
                            actor="t")
    assert headroom(Task.objects.get(pk=task.pk).state) == {"money": 100, "tokens": 0, "tool_calls": 0, "retries": 0}
    task = budget_release(task_id=task.pk, reservation_ids=[res.id], reason="unused", actor="t")
    assert headroom(task.state) == {"money": 100, "tokens": 1000, "tool_calls": 3, "retries": 2}


def test_a_request_is_refused_when_todays_quota_left_is_less_than_its_budget(requester, device):
    tenant = device.tenant
    tenant.daily_budget_units = 158
    tenant.save()
    a = _running(requester, device)
    _, res = budget_reserve(task_id=a.pk, activity="x", amounts={"money": 55}, actor="t")
    task_submit(principal=p(requester), device_id=device.pk, symptom="Second request: 103 units left")
    budget_settle(task_id=a.pk, reservation_id=res.id, used={"money": 55}, actor="t")
    b = _running(requester, device)
    budget_reserve(task_id=b.pk, activity="x", amounts={"money": 4}, actor="t")
    with pytest.raises(QuotaExceeded, match="has 99 of today's 158 cost units left, less than one request's budget"):
        task_submit(principal=p(requester), device_id=device.pk, symptom="Third request: 99 units left")


def test_an_ending_task_releases_what_is_reserved_and_a_cancel_waits_for_the_activity(requester, device):
    task = _running(requester, device)
    _, res = budget_reserve(task_id=task.pk, activity="model_call", amounts={"money": 7, "tokens": 500}, actor="t")
    task = task_cancel(principal=p(requester), task_id=task.pk)
    # The activity in flight keeps its reservation until it reports what it cost.
    assert task.status == reducer.CANCELLED and res.id in task.state["reservations"]
    with pytest.raises(reducer.IllegalTransition, match="task is terminal"):
        budget_reserve(task_id=task.pk, activity="model_call", amounts={"money": 1}, actor="t")
    task = budget_settle(task_id=task.pk, reservation_id=res.id, used={"money": 7, "tokens": 500}, actor="t",
                         event_type="model.called", extra={"outcome": "cancelled", "usage": None})
    assert (task.budget_used, task.budget_reserved, task.state["reservations"]) == (7, 0, {})

    other = _running(requester, device)
    budget_reserve(task_id=other.pk, activity="context_read", amounts={"tool_calls": 3}, actor="t")
    other = task_append_event(task=Task.objects.get(pk=other.pk), event_type="task.failed",
                              payload={"reason": "test"}, actor="t")
    assert other.state["reservations"] == {} and other.state["limits"]["tool_calls"]["reserved"] == 0


def test_the_sweeper_charges_a_cancelled_tasks_orphaned_reservation_in_full(requester, device):
    task = _running(requester, device)
    budget_reserve(task_id=task.pk, activity="model_call", amounts={"money": 9, "tokens": 700}, actor="t")
    task_cancel(principal=p(requester), task_id=task.pk)
    assert orphaned_reservations_settle(task_id=task.pk) is True
    task = Task.objects.get(pk=task.pk)
    assert (task.budget_used, task.budget_reserved, task.state["reservations"]) == (9, 0, {})
    assert task.state["limits"]["tokens"]["used"] == 700, "unknown outcome: charged at the reservation"
    settled = TaskEvent.objects.filter(task=task, type="budget.settled").get()
    assert settled.payload["unknown_outcome"] is True
    assert settled.payload["reason"].startswith("the activity's worker lost its lease")
    assert orphaned_reservations_settle(task_id=task.pk) is False


def test_tenant_quota_stops_one_tenant_not_the_other(requester, device, other_tenant_user, settings):
    from tests.factories import DeviceFactory

    tenant = device.tenant
    tenant.daily_budget_units = 30
    tenant.save()
    a = _running(requester, device)
    b = _running(requester, device)
    budget_reserve(task_id=a.pk, activity="x", amounts={"money": 25}, actor="t")
    with pytest.raises(BudgetExceeded) as refused:
        budget_reserve(task_id=b.pk, activity="x", amounts={"money": 6}, actor="t")
    assert refused.value.scope == "tenant" and refused.value.reason.startswith("tenant_quota_exhausted: tenant money")
    assert Task.objects.get(pk=b.pk).budget_reserved == 0, "nothing written for the refused reservation"
    budget_reserve(task_id=b.pk, activity="x", amounts={"money": 5}, actor="t")  # exactly to the quota
    # Today's quota is used: a new request of this tenant is refused with 429, until midnight UTC …
    with pytest.raises(QuotaExceeded, match="has 0 of today's 30 cost units left") as refused:
        task_submit(principal=p(requester), device_id=device.pk, symptom="Another jam in tray 2")
    from django.utils import timezone

    now = timezone.now()
    to_midnight = 86400 - (now.hour * 3600 + now.minute * 60 + now.second)
    assert abs(refused.value.extra["retry_after"] - to_midnight) <= 2
    # … while another tenant files and reserves as usual.
    gus_device = DeviceFactory(tenant=other_tenant_user.memberships.get().tenant, asset_tag="PRN-9000")
    other = task_submit(principal=p(other_tenant_user), device_id=gus_device.pk, symptom="Paper jam in tray 1").task
    assert other.status == reducer.ACCEPTED


def test_open_request_limit_answers_429_over_the_api(client, requester, device):
    tenant = device.tenant
    tenant.max_active_tasks = 2
    tenant.save()
    client.force_login(requester)
    for i in range(2):
        assert client.post("/api/tasks/", {"device_id": device.pk, "symptom": f"Fault number {i}"},
                           content_type="application/json").status_code == 201
    refused = client.post("/api/tasks/", {"device_id": device.pk, "symptom": "Fault number 3"},
                          content_type="application/json")
    assert refused.status_code == 429 and refused["Retry-After"] == "60"
    assert refused.json()["error"] == "quota_exceeded" and "2 open requests" in refused.json()["detail"]
    assert Task.objects.count() == 2


def test_activity_timeout_is_bounded_by_the_deadline_minus_cleanup(requester, device, settings):
    from datetime import timedelta

    task = _running(requester, device)
    now = task.deadline_at - timedelta(seconds=12)
    assert activity_timeout(task, wanted=30, now=now) == 7.0  # 12 s left − 5 s to persist and clean up
    assert activity_timeout(task, wanted=3, now=now) == 3.0
    assert activity_timeout(task, wanted=30, now=task.deadline_at - timedelta(seconds=5.5)) is None


@pytest.mark.django_db(transaction=True)
def test_many_processes_reserving_against_one_task_never_pass_b(requester, device, settings, tmp_path):
    """4 processes × 60 reservations (money 1–15, tokens 0–400), each settled at a random
    ``c ≤ r`` or released, against one task with B=300: ``U + R ≤ B`` on every sample of the row
    and at every prefix of the event log; at the end ``R = 0`` and ``U`` is the sum of what the
    processes settled, on the task and on the tenant's day row."""
    settings.FAULTDESK = {**settings.FAULTDESK, "TASK_BUDGET_UNITS": 300, "TASK_TOKEN_LIMIT": 20000}
    task = _running(requester, device)
    go = tmp_path / "go"
    env = {"DJANGO_SETTINGS_MODULE": "config.settings.local", "DATABASE_URL": database_url(), "PATH": ""}
    import os

    env = {**os.environ, **env}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.ledger_worker", str(task.pk), "60", str(seed), str(go)],  # noqa: S603
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in range(4)]
    samples, stop = [], threading.Event()

    def sample() -> None:
        from django.db import connections

        while not stop.is_set():
            samples.append(Task.objects.values_list("budget_total", "budget_used", "budget_reserved").get(pk=task.pk))
            time.sleep(0.005)
        connections.close_all()

    watcher = threading.Thread(target=sample)
    time.sleep(2)  # let the children import Django and wait on the go file
    go.touch()
    watcher.start()
    outs = [proc.communicate(timeout=300) for proc in procs]
    stop.set()
    watcher.join()
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
    summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    print(f"ledger concurrency: {len(samples)} samples, max U+R {max(u + r for _, u, r in samples)} of B 300, "
          f"admitted {sum(s['admitted'] for s in summaries)}, refused {sum(s['refused'] for s in summaries)}, "
          f"released {sum(s['released'] for s in summaries)}, U {sum(s['settled_money'] for s in summaries)}")
    assert len(samples) > 50 and all(u + r <= b for b, u, r in samples)
    assert max(u + r for _, u, r in samples) > 200, "the run pressed against the budget"
    admitted = sum(s["admitted"] for s in summaries)
    refused = sum(s["refused"] for s in summaries)
    assert admitted + refused == 240 and refused > 0 and admitted > 20
    task = Task.objects.get(pk=task.pk)
    assert task.budget_reserved == 0 and task.state["reservations"] == {}
    assert task.budget_used == sum(s["settled_money"] for s in summaries) <= 300
    assert task.state["limits"]["tokens"]["used"] == sum(s["settled_tokens"] for s in summaries)
    assert TaskEvent.objects.filter(task=task, type="budget.reserved").count() == admitted
    assert TaskEvent.objects.filter(task=task, type="budget.released").count() == sum(s["released"] for s in summaries)
    # every prefix of the log keeps the invariant
    state = reducer.initial_state()
    for etype, payload in TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", "payload"):
        state = reducer.reducer_for("reducer/3")(state, etype, payload)
        b = state["budget"]
        assert b["used"] + b["reserved"] <= b["total"]
    row = TenantUsage.objects.get(tenant=task.tenant)
    assert (row.money_used, row.money_reserved, row.tokens_used, row.tokens_reserved) == (
        task.budget_used, 0, task.state["limits"]["tokens"]["used"], 0)
    connection.close()


# --- δ-level property: any sequence of reservations, settlements, releases, cancel and failure ---------

_AMOUNTS = st.fixed_dictionaries({"money": st.integers(0, 40), "tokens": st.integers(0, 500),
                                  "tool_calls": st.integers(0, 3), "retries": st.integers(0, 2)})
_OPS = st.one_of(
    st.tuples(st.just("reserve"), st.integers(0, 5), _AMOUNTS),
    st.tuples(st.just("settle"), st.integers(0, 5), st.fixed_dictionaries(
        {d: st.floats(0, 1.2) for d in reducer_v3.DIMENSIONS})),
    st.tuples(st.just("release"), st.integers(0, 5), st.none()),
    st.tuples(st.just("cancel"), st.none(), st.none()),
    st.tuples(st.just("fail"), st.none(), st.none()),
)


@pytest.mark.property
@given(ops=st.lists(_OPS, max_size=25))
def test_the_ledger_invariants_hold_for_any_sequence(ops):
    """For any sequence: every account keeps ``0 ≤ reserved`` and ``used + reserved ≤ total``;
    ``reserved`` equals the sum of the open reservations; ``used`` equals the sum of what was
    settled; a refused event changes nothing; nothing is reserved after a cancel or an end."""
    reduce = reducer_v3.reduce
    state = reduce(reducer.initial_state(), "task.accepted", {
        "request": {"device_id": 1, "symptom": "x", "urgency": "normal"}, "budget_total": 100,
        "limits": {"tokens": 1000, "tool_calls": 6, "retries": 3}})
    state = reduce(state, "retrieval.started", {})
    settled = dict.fromkeys(reducer_v3.DIMENSIONS, 0)
    for op, idx, arg in ops:
        rid = f"r{idx}"
        if op == "reserve":
            etype, payload = "budget.reserved", {"reservation_id": rid, "activity": "p", "amounts": arg}
        elif op == "settle":
            amounts = (state["reservations"].get(rid) or {}).get("amounts") or dict.fromkeys(reducer_v3.DIMENSIONS, 1)
            used = {d: int(amounts[d] * arg[d]) for d in reducer_v3.DIMENSIONS}
            etype, payload = "budget.settled", {"reservation_id": rid, "used": used}
        elif op == "release":
            etype, payload = "budget.released", {"reservation_ids": [rid], "reason": "p"}
        elif op == "cancel":
            etype, payload = "cancel.requested", {}
        else:
            etype, payload = "task.failed", {"reason": "p"}
        try:
            nxt = reduce(state, etype, payload)
        except reducer.IllegalTransition:
            continue  # refused: the state stays as it was (δ is pure)
        if etype == "budget.reserved":
            assert state["status"] not in reducer.TERMINAL
        if etype == "budget.settled":
            for d in reducer_v3.DIMENSIONS:
                assert payload["used"][d] <= state["reservations"][rid]["amounts"][d]
                settled[d] += payload["used"][d]
        state = nxt
        for d in reducer_v3.DIMENSIONS:
            acct = state["budget"] if d == "money" else state["limits"][d]
            assert 0 <= acct["reserved"] and acct["used"] + acct["reserved"] <= acct["total"]
            assert acct["reserved"] == sum(r["amounts"][d] for r in state["reservations"].values())
            assert acct["used"] == settled[d]
        if state["status"] == reducer.FAILED:
            assert state["reservations"] == {}


def _other_session():
    """A second, independent session of the test database (autocommit)."""
    import psycopg

    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    return psycopg.connect(**params, autocommit=True)


def _tenant_key_share_nowait(tenant_id) -> None:
    """From a second session: take the lock a foreign-key check takes on the tenant row (``FOR
    KEY SHARE``) without waiting; raises ``LockNotAvailable`` when another transaction holds a
    conflicting lock on it."""
    with _other_session() as other:
        other.execute("SELECT 1 FROM accounts_tenant WHERE id = %s FOR KEY SHARE NOWAIT", [tenant_id])


@pytest.mark.django_db(transaction=True)
def test_ledger_writes_lock_the_task_row_and_leave_the_tenant_row_to_other_transactions(requester, device):
    """A reservation (and a batch of events) locks its task rows only: with the tenant row locked
    too, every other transaction of the tenant waited at its commit's foreign-key check (events,
    actions, outbox rows all reference the tenant), and one inserting the tenant's day row at the
    same time deadlocked with it (PostgreSQL broke the cycle after deadlock_timeout, 1 s)."""
    from django.db import transaction

    from apps.tasks.batch import task_events_prepare

    task = _running(requester, device)
    with transaction.atomic():
        budget_reserve(task_id=task.pk, activity="a", amounts={"money": 5}, actor="test")
        _tenant_key_share_nowait(task.tenant_id)  # LockNotAvailable when the tenant row is locked
    with transaction.atomic():
        prepared, refused = task_events_prepare(
            [(task.pk, "cancel.requested", lambda t: {"reason": "lock scope"}, "user:test")])
        assert [p_.task.pk for p_ in prepared] == [task.pk] and refused == []
        _tenant_key_share_nowait(task.tenant_id)
        # the task row itself is locked: another session cannot take it
        import psycopg

        with _other_session() as other, pytest.raises(psycopg.errors.LockNotAvailable):
            other.execute("SELECT 1 FROM tasks_task WHERE id = %s FOR UPDATE NOWAIT", [task.pk])


@pytest.mark.django_db(transaction=True)
def test_a_submit_admission_lock_leaves_the_tenant_row_to_foreign_key_checks(requester, device):
    """``task_submit`` serializes the tenant's submits on its row, with a lock (NO KEY UPDATE) that
    foreign-key checks of the tenant's other transactions do not wait for."""
    from django.db import transaction

    with transaction.atomic():
        task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2")
        _tenant_key_share_nowait(device.tenant_id)
