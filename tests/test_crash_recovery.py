"""Crash recovery with real processes (DESIGN.md §5, §6 table 16.5).

A Celery worker (solo pool: the worker *is* the process that runs the step) is SIGKILLed by a
failpoint at a step boundary; a new worker is then started. Beat runs the lease sweeper with short
leases, so the work the dead worker held is re-queued. Every task must reach the state it would
have reached without the crash, with one recorded proposal per logical proposal and exactly one
external effect per action key.
"""

from __future__ import annotations

import time

import httpx
import pytest

from apps.events.models import RefusedEvent, TaskEvent
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from tests.procs import running_stack
from tests.test_e2e import poll, ref_client, seed_acme

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

FAST = {
    "FAULTDESK_LEASE_SECONDS": "3",
    "FAULTDESK_OUTBOX_LEASE_SECONDS": "3",
    "FAULTDESK_SWEEPER_IDLE_SECONDS": "2",
    "FAULTDESK_SWEEP_EVERY_SECONDS": "1",
}


@pytest.fixture(params=[None])
def stack(request, transactional_db, tmp_path):
    """The stack on the default broker; a test parametrized with ``stack=["amqp"]`` (indirect) runs
    on RabbitMQ."""
    with running_stack(tmp_path, request.param, **FAST) as s:
        yield s


def _wait_for(path, timeout: float, stack) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return
        time.sleep(0.1)
    raise AssertionError(f"failpoint never fired\n{stack.logs()}")


def _file(stack, device) -> str:
    riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
    resp = riley.post("/api/tasks/", json={"device_id": device.pk, "symptom": "Fuser error after warm-up; smeared.",
                                           "urgency": "high"})
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


LEDGER = ("budget.reserved", "budget.settled", "budget.released", "model.called")


def _assert_completed_once(stack, task_id) -> Task:
    riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
    done = poll(riley, task_id, {"COMPLETED", "FAILED", "CANCELLED"}, 150, stack)
    assert done["status"] == "COMPLETED", stack.logs()
    task = Task.objects.get(pk=task_id)
    types = list(TaskEvent.objects.filter(task=task).order_by("seq").exclude(type__in=LEDGER)
                 .values_list("type", flat=True))
    # reducer/6: one plan version, then its three reads, each reported once by its own event in whatever order
    # they finished (the ticket read by its activity, the device read and retrieval by the dispatching run)
    assert types[:3] == ["task.accepted", "retrieval.started", "plan.activated"], types
    assert sorted(types[3:6]) == ["device.read", "evidence.retrieved", "ticket.read"], types
    assert types[6:] == ["draft.proposed", "intent.committed", "receipt.recorded", "task.completed"], types
    # A worker killed inside an activity left its reservation open: the next lease charged it in full.
    assert task.state["reservations"] == {} and task.budget_reserved == 0
    assert all(acct["reserved"] == 0 for acct in task.state["limits"].values())
    key = task.state["action"]["idempotency_key"]
    ref = ref_client(stack)
    assert ref.get("/_admin/effects", params={"idempotency_key": key}).json()["effects"] == 1
    assert len(ref.get("/_admin/tickets").json()["results"]) == 1
    result = task_replay(task)
    assert result.ok, result.detail
    return task


POINTS = [
    "after_commit:retrieval.started",  # after a commit, before the next enqueue (lease still held)
    "before_commit:evidence.retrieved",  # tools step: retrieval done, not yet recorded
    "model_call",  # in the middle of a model call
    "before_commit:draft.proposed",  # the model answered, the answer is not recorded
    "after_commit:intent.committed",  # intent + outbox row committed
    "after_send",  # the remote created the ticket, the worker died before recording it
    # the run delivered its own row (direct delivery): the receipt on the outbox's rows, the
    # task's receipt and its completion are one commit; a death before it loses all three, the
    # row's lease expires and a dispatcher resends with the same key
    "before_commit:task.completed",
]


# Every point on the default broker; on RabbitMQ, the worker killed after the remote made the ticket:
# the message it took but never acknowledged goes back to the queue the moment its connection drops
# (acks_late), and the next worker takes it — or the sweeper's re-queue, whichever comes first.
# FAULTDESK_TEST_BROKER=amqp runs every point there.
@pytest.mark.parametrize(("stack", "point"), [*((None, point) for point in POINTS), ("amqp", "after_send")],
                         indirect=["stack"])
def test_sigkill_at_a_step_boundary_then_a_new_worker_finishes(stack, point, tmp_path):
    tenant, requester, device = seed_acme(auto_approve=True)
    fired = tmp_path / "failpoint-fired"
    stack.start_worker("doomed", pool="solo", FAULTDESK_FAILPOINT=point, FAULTDESK_FAILPOINT_ONCE=str(fired))
    task_id = _file(stack, device)
    _wait_for(fired, 120, stack)
    assert stack.wait_exit("doomed", 30) == -9  # SIGKILL
    stack.start_worker("survivor")
    task = _assert_completed_once(stack, task_id)
    if stack.broker_kind == "amqp":
        assert '"Connected to amqp://' in stack.log("survivor")
    if point == "after_send":
        # The re-sent request carried the same key; the service answered with the stored ticket.
        assert task.state["receipt"]["replayed"] is True
    if point == "before_commit:task.completed":
        # Nothing of the receipt was committed before the death: the request was sent again with the
        # same key, and the service answered with the ticket it had made (one ticket, checked above).
        assert task.state["receipt"]["replayed"] is True
        key = task.state["action"]["idempotency_key"]
        assert ref_client(stack).get("/_admin/effects", params={"idempotency_key": key}).json()["requests"] == 2


def test_sigkill_after_the_dispatchers_receipt_before_the_task_learns_it(stack, tmp_path):
    """With direct delivery off, the dispatcher records a batch's receipts on the outbox's rows and
    the task learns them in a second commit (``settle_receipts``): a death between the two leaves
    the receipt durable on the action's row, and the next worker settles the task from the row —
    nothing is sent again."""
    tenant, requester, device = seed_acme(auto_approve=True)
    fired = tmp_path / "failpoint-fired"
    off = {"FAULTDESK_OUTBOX_DIRECT_DELIVERY": "false"}
    stack.start_worker("doomed", pool="solo", FAULTDESK_FAILPOINT="before_commit:task.completed",
                       FAULTDESK_FAILPOINT_ONCE=str(fired), **off)
    task_id = _file(stack, device)
    _wait_for(fired, 120, stack)
    assert stack.wait_exit("doomed", 30) == -9  # SIGKILL
    stack.start_worker("survivor", **off)
    task = _assert_completed_once(stack, task_id)
    assert task.state["receipt"]["replayed"] is False
    key = task.state["action"]["idempotency_key"]
    assert ref_client(stack).get("/_admin/effects", params={"idempotency_key": key}).json()["requests"] == 1


def _stalled_then_taken_over(stack, tmp_path, point: str, seconds: int) -> Task:
    """Worker A stalls ``seconds`` at failpoint ``point`` (past its 3 s lease); worker B starts
    once A stalled. Returns the task once completed (checked by :func:`_assert_completed_once`)."""
    tenant, requester, device = seed_acme(auto_approve=True)
    fired = tmp_path / "failpoint-fired"
    stack.start_worker("paused", pool="solo", FAULTDESK_FAILPOINT=point, FAULTDESK_FAILPOINT_ONCE=str(fired),
                       FAULTDESK_FAILPOINT_ACTION=f"sleep:{seconds}")
    task_id = _file(stack, device)
    _wait_for(fired, 120, stack)
    stack.start_worker("taker")
    return _assert_completed_once(stack, task_id)


def test_paused_worker_cannot_commit_after_its_lease_passed_on(stack, tmp_path):
    """Worker A stalls after its local reads (reducer/6: the device read and retrieval of the
    dispatching run), before recording the first of them (its run's transaction holds nothing: the
    reads ran after a checkpoint), past its lease; the sweeper hands the task on under a new lease
    generation, worker B takes it, reads again and completes the task while A still stalls; when A
    wakes, its commit is refused and recorded. A is woken only once B has finished, so the order
    does not depend on how fast a worker starts on a busy machine."""
    _, _, device = seed_acme(auto_approve=True)
    fired, wake = tmp_path / "failpoint-fired", tmp_path / "wake"
    stack.start_worker("paused", pool="solo", FAULTDESK_FAILPOINT="before_commit:device.read",
                       FAULTDESK_FAILPOINT_ONCE=str(fired), FAULTDESK_FAILPOINT_ACTION=f"wait:{wake}")
    task_id = _file(stack, device)
    _wait_for(fired, 120, stack)
    stalled_generation = Task.objects.get(pk=task_id).lease_generation
    stack.start_worker("taker")
    task = _assert_completed_once(stack, task_id)
    assert not RefusedEvent.objects.filter(task=task).exists()  # A has not tried to commit yet
    wake.touch()
    deadline = time.monotonic() + 30
    while not RefusedEvent.objects.filter(task=task, type="device.read").exists() \
            and time.monotonic() < deadline:
        time.sleep(0.3)
    refused = RefusedEvent.objects.get(task=task, type="device.read")
    assert "lease lost" in refused.reason
    assert refused.lease_generation == stalled_generation
    read = TaskEvent.objects.get(task=task, type="device.read")
    assert read.actor != refused.actor  # the task holds B's result only
    assert read.lease_generation > refused.lease_generation
    assert Task.objects.get(pk=task_id).version == task.version  # the refused commit appended nothing


def test_a_worker_paused_inside_its_runs_transaction_is_not_overtaken(stack, tmp_path):
    """Worker A stalls past its lease in the middle of its run's transaction (its draft decided,
    not yet committed): the task row stays locked by that transaction, so worker B, sent by the
    sweeper, skips the task instead of running the same steps beside it. A wakes and commits; the
    task holds one draft, one intent and one ticket. (A session stalled longer than
    ``idle_in_transaction_session_timeout`` is ended by PostgreSQL, which rolls its transaction back;
    B then takes the task as after a crash.)"""
    task = _stalled_then_taken_over(stack, tmp_path, "before_commit:draft.proposed", 8)
    assert not RefusedEvent.objects.filter(task=task).exists()
    [proposal] = TaskEvent.objects.filter(task=task, type="draft.proposed")
    # reducer/6 drafts in the run of the read that completed the join: the last read recorded
    joined = TaskEvent.objects.filter(task=task, type__in=["device.read", "evidence.retrieved", "ticket.read"]
                                      ).order_by("-seq").first()
    assert proposal.actor == joined.actor and proposal.lease_generation == joined.lease_generation
