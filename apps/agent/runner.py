"""The step table (DESIGN.md §1, §5): a run takes the lease and, while the task can move on, runs
the handler for its recorded status. Each handler returns True when another step should follow at
once. The runner is re-entrant: it looks at the recorded state and does the next thing, so a crash
anywhere resumes from the last committed event.

**Pools.** A run belongs to a pool — the Celery queue whose worker runs it: ``agent`` (model steps)
or ``tools`` (the context reads) — and goes on inline while the next step may run on that pool
(:func:`pool_for`). The context reads need the ``tools`` pool, a call to a hosted model the
``agent`` pool; every other step (recording that retrieval starts, the in-process local drafter,
validation, policy, the intent, the answer) runs on whichever pool the run is on. When the next step
needs the other pool, the run hands the task over with one message, after its lease is given back.
A report thus crosses Celery once before its intent when the model is local (web → ``tools``), and
never waits in a second queue for a step that makes no outside call.

**Commits.** A run takes its lease in a commit of its own, then records its events in a
:class:`~apps.tasks.runs.RunTransaction`: they commit together at the run's checkpoints — before each
activity that leaves the process (which runs outside any transaction) — and at its end, with the lease's
release, instead of one commit per event (docs/architecture.md §4)."""

from __future__ import annotations

import logging
import time
import uuid

from apps.agent.authorization import (
    resume_after_approval,
    validate_and_authorize,
)
from apps.agent.bundle import USES_BUNDLE, bundle_problem
from apps.agent.common import (
    MAX_STEPS_PER_RUN,
    RUN_POOL,
    TOOLS_POOL,
    actor_of,
    bounds_exceeded,
    fail,
    has_ledger,
    keeps_plans,
    release_stale,
)
from apps.agent.compensation import compensate, compensation_due, compensation_request, created_ticket
from apps.agent.context import context_step
from apps.agent.drafting import propose
from apps.agent.intent import direct_deliveries_forget, direct_delivery_take
from apps.agent.reads import ReadOutcome, activity_open, read_perform, read_record, reads_step
from apps.core import sql
from apps.core.queue import AGENT_STEP, READ_CONTEXT, enqueue_on_commit
from apps.events.models import RefusedEvent
from apps.llm.providers import runs_in_process
from apps.outbox.direct import direct_receipt_record, direct_send
from apps.outbox.receipts import receipt_unsettled
from apps.outbox.settlement import receipt_record
from apps.tasks import reducer
from apps.tasks.answer import completion_event
from apps.tasks.budget import budget_settle, stale_reservations
from apps.tasks.leases import Lease, task_claim_read, task_release
from apps.tasks.models import Task
from apps.tasks.runs import RunTransaction, checkpoint, open_run, run_current_task
from apps.tasks.store import StaleWrite, refused_event_record, task_append_event
from apps.tasks.usage import BudgetExceeded
from config.logs import bind

log = logging.getLogger(__name__)

#: the pools a run can be on, by the Celery task (and queue) that starts it
AGENT, TOOLS = "agent", TOOLS_POOL
#: a step that may run on any pool
ANY = "any"
#: the Celery task that starts a run on each pool
POOL_TASK = {AGENT: AGENT_STEP, TOOLS: READ_CONTEXT}


def pool_for(task: Task) -> str:
    """The pool whose worker may run ``task``'s next step: ``tools`` for the context reads
    (RETRIEVING), ``agent`` for a draft by a model outside the process (PROPOSING with a hosted
    model pinned), otherwise ``any``."""
    if task.status == reducer.RETRIEVING:
        # reducer/6 dispatches its reads as activities of their own: the dispatch runs anywhere
        return ANY if keeps_plans(task) else TOOLS
    if task.status == reducer.PROPOSING and not runs_in_process(task.artifact_bundle):
        return AGENT
    return ANY


def agent_run(*, task_id: uuid.UUID, pool: str = AGENT) -> None:
    """Run ``task_id``'s next steps on ``pool`` until it waits, ends, or its next step needs the
    other pool (then it is handed over, after the lease is given back). Returns quietly when
    another worker holds the lease or the task is terminal.

    The lease claim commits first, alone (a fencing token is never given out twice), and reads the
    task in the same statement; the events and the release commit at the run's checkpoints
    (:class:`~apps.tasks.runs.RunTransaction`).
    An exception other than the refusals the run expects ends the run with what it recorded
    committed (unless the transaction broke) and the lease given back, and is raised: the Celery
    task retries a retryable database refusal, and the sweeper brings the task back otherwise."""
    # The claim commits by itself: a fencing token is given out once, whatever becomes of the run's
    # transaction (a rolled-back claim would hand the same token to the next worker). Its statement
    # also reads the task with its device, tenant and requester.
    claimed = task_claim_read(task_id=task_id, related=_RELATED)
    if claimed is None:
        return
    lease, first = claimed
    pool_token = RUN_POOL.set(pool)
    try:
        with RunTransaction():
            handover = _run_steps(task_id, lease, pool, first)
            task_release(lease=lease)
    except BaseException:
        task_release(lease=lease)  # a no-op once the lease passed on (another fencing token)
        raise
    finally:
        direct_deliveries_forget(lease)  # a row claimed and not delivered waits for its lease's end
        RUN_POOL.reset(pool_token)
    if handover is not None:
        enqueue_on_commit(POOL_TASK[handover], task_id)


#: how long a read activity tries to take the task's lease to report (seconds); its first pause, the
#: factor each pause grows by and the longest pause (seconds): a report waits for the lease at most
#: REPORT_PAUSE_MAX past its release, at the cost of one claim statement per pause
REPORT_PATIENCE, REPORT_PAUSE, REPORT_PAUSE_GROWTH, REPORT_PAUSE_MAX = 30.0, 0.002, 1.5, 0.05


def read_activity_run(*, task_id: uuid.UUID, activity_id: str) -> None:
    """A read activity of ``reducer/6`` (the ``read_step`` Celery task, ``tools`` pool): do the read
    without the lease, then take the lease (waiting while another run holds it) to report it
    (:func:`apps.agent.reads.read_record`), and go on with the task's next steps in the same run
    when the read completed the join. Returns quietly when the task is gone, the activity unknown or
    already reported, or the lease could not be had within ``REPORT_PATIENCE`` (the read then lapses
    at its deadline and is read again)."""
    task = sql.row(Task, "t0.id = %s", [task_id], related=_RELATED)
    if task is None:
        return
    activity = activity_open(task.state, activity_id)
    if activity is None:
        return  # reported already, or closed (settled unjoined): a redelivered message reads nothing
    if task.status in reducer.TERMINAL:
        # nothing waits for this read: a completed or failed task released its reservation, a
        # cancelled one kept it for the read to settle — at nothing, since it does not read now
        _settle_unread(task, activity_id)
        return
    outcome, raised = None, None
    if not task.state.get("cancel_requested"):
        timeout = (task.state.get("reservations") or {}).get(activity_id, {}).get("timeout_s")
        try:
            outcome = read_perform(task, activity, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - recorded as a failed read (its cost settled), then raised
            raised = exc
            outcome = ReadOutcome(step=activity["step"], premises=activity["premises"], made=1,
                                  error=f"the read raised {exc!r}"[:500])
    claimed = _claim_patiently(task_id)
    if claimed is None:
        log.warning("read %s of %s could not report: the lease stayed taken", activity_id, task_id)
        return
    lease, first = claimed
    pool_token = RUN_POOL.set(TOOLS)
    handover = None
    try:
        with RunTransaction():
            bind(tenant_id=first.tenant_id, task_id=first.pk, lease_generation=lease.generation, step="read")
            try:
                task, go_on = read_record(first, lease, activity_id, outcome)
            except StaleWrite:
                go_on = False
            except reducer.IllegalTransition as exc:
                log.warning("read %s of %s refused: %s", activity_id, task_id, exc)
                go_on = False
            if go_on:
                task.tenant, task.requester, task.device = first.tenant, first.requester, first.device
                handover = _run_steps(task_id, lease, TOOLS, task)
            task_release(lease=lease)
    except BaseException:
        task_release(lease=lease)
        raise
    finally:
        direct_deliveries_forget(lease)
        RUN_POOL.reset(pool_token)
    if handover is not None:
        enqueue_on_commit(POOL_TASK[handover], task_id)
    if raised is not None:
        raise raised


def _settle_unread(task: Task, activity_id: str) -> None:
    """Settle at nothing the open reservation of a read that will not read (its task ended), without
    a lease (nobody runs an ended task's reads); a task that moved meanwhile is left to the sweeper."""
    if activity_id not in (task.state.get("reservations") or {}):
        return
    try:
        budget_settle(task_id=task.pk, reservation_id=activity_id, used={}, actor="worker:read",
                      extra={"unjoined": True, "reason": "the task ended before the read ran"})
    except (StaleWrite, reducer.IllegalTransition):
        log.info("read %s of %s: left to the sweeper", activity_id, task.pk)


def _claim_patiently(task_id: uuid.UUID) -> tuple[Lease, Task] | None:
    """The task's lease and row (:func:`~apps.tasks.leases.task_claim_read`), trying again while
    another run holds it after a pause that starts at ``REPORT_PAUSE`` and grows by
    ``REPORT_PAUSE_GROWTH`` up to ``REPORT_PAUSE_MAX`` seconds (2, 3, 4.5 … 50 ms: the lease is taken
    at most 50 ms after it is released, with about 20 statements a second while it is held), at most
    ``REPORT_PATIENCE`` seconds; None after that, or when the task is gone or ended."""
    deadline, pause = time.monotonic() + REPORT_PATIENCE, REPORT_PAUSE
    while True:
        claimed = task_claim_read(task_id=task_id, related=_RELATED)
        if claimed is not None or time.monotonic() >= deadline:
            return claimed
        if not Task.objects.filter(pk=task_id).exclude(status__in=list(reducer.TERMINAL)).exists():
            return None  # gone or ended: its open reservations are settled by the sweeper
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * REPORT_PAUSE_GROWTH, REPORT_PAUSE_MAX)


def context_read(*, task_id: uuid.UUID) -> None:
    """A run on the ``tools`` pool (the ``read_context`` Celery task): the context reads, and the
    steps after them that may run there (see :func:`pool_for`)."""
    agent_run(task_id=task_id, pool=TOOLS)


def _run_steps(task_id: uuid.UUID, lease: Lease, pool: str, first: Task) -> str | None:
    """The loop of :func:`agent_run` under ``lease``, from ``first`` (the task as the claim read
    it, with its device, tenant and requester); returns the pool to hand the task over to, or
    None. The refusals a run expects end it here, recorded: a lost lease or CAS (``StaleWrite``),
    an event δ refused (``IllegalTransition``). A task pinned to a prompt, parser, controller or
    tool schema this build does not carry fails at once (:mod:`apps.agent.bundle`)."""
    try:
        bind(tenant_id=first.tenant_id, task_id=first.pk, lease_generation=lease.generation, step=f"run:{pool}")
        if has_ledger(first) and stale_reservations(first, lease.generation):
            release_stale(first, lease)
            first = _read_with_related(task_id)
        if first.status in USES_BUNDLE and (problem := bundle_problem(first.artifact_bundle)):
            # pinned to code this build no longer has: refused, recorded, never run with other code
            log.warning("task %s: %s", task_id, problem)
            if (first.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION) not in reducer.REDUCERS:
                # not even task.failed can be reduced: the refusal is recorded once, the task left as it is
                if not RefusedEvent.objects.filter(task_id=task_id, reason__startswith="bundle_unsupported").exists():
                    refused_event_record(task=first, event_type="task.failed", actor=actor_of(lease),
                                         lease_generation=lease.generation,
                                         payload={"reason": f"bundle_unsupported: {problem}"},
                                         reason=f"bundle_unsupported: {problem}")
                return None
            task_append_event(task=first, event_type="task.failed", actor=actor_of(lease),
                              lease_generation=lease.generation, payload={"reason": f"bundle_unsupported: {problem}"})
            return None
        for i in range(MAX_STEPS_PER_RUN):
            task = (run_current_task(task_id, lease.generation) or _reread(task_id)) if i else first
            task.tenant, task.requester, task.device = first.tenant, first.requester, first.device
            needs = pool_for(task)
            if needs not in (pool, ANY):
                return needs
            try:
                if not step(task, lease):
                    break
            except BudgetExceeded as exc:
                # e.g. the tenant's daily quota refused an intent's reservation: nothing was written
                task = Task.objects.select_related("tenant").get(pk=task_id)
                if task.status in reducer.TERMINAL or task.status == reducer.WAITING_COMPENSATION:
                    break
                event = "compensation.failed" if task.status == reducer.COMPENSATING else "task.failed"
                task_append_event(task=task, event_type=event, actor=actor_of(lease), lease_generation=lease.generation,
                                  payload={"reason": exc.reason})
                break
    except StaleWrite:
        log.info("run on %s lost the lease on %s", pool, task_id)
    except reducer.IllegalTransition as exc:
        # Already recorded as a refused event; the task stays as it was.
        log.warning("run on %s for %s: %s", pool, task_id, exc)
    return None


#: the rows a run reads with its task, once, at its claim
_RELATED = ("device", "tenant", "requester")


def _read_with_related(task_id: uuid.UUID) -> Task:
    """The task row with its device, tenant and requester (one statement, :mod:`apps.core.sql`).
    Raises ``Task.DoesNotExist``."""
    task = sql.row(Task, "t0.id = %s", [task_id], related=_RELATED)
    if task is None:
        raise Task.DoesNotExist(f"task {task_id}")
    return task


def _reread(task_id: uuid.UUID) -> Task:
    """The task row as it stands now (its tenant, requester and device are the ones read at the
    run's start: a step changes the task row only). One statement (:mod:`apps.core.sql`); raises
    ``Task.DoesNotExist``."""
    task = sql.row(Task, "t0.id = %s", [task_id])
    if task is None:
        raise Task.DoesNotExist(f"task {task_id}")
    return task


def retrieval_start(task: Task, lease: Lease) -> bool:
    """ACCEPTED: record ``retrieval.started``; the context reads follow (on the ``tools`` pool)."""
    task_append_event(task=task, event_type="retrieval.started", actor=actor_of(lease),
                      lease_generation=lease.generation, payload={})
    return True


def receipt_settle(task: Task, lease: Lease) -> bool:
    """Record ``receipt.recorded`` when the current action's row holds a receipt the task has not
    recorded (the dispatcher's batch records receipts on its rows and settles the tasks after its
    commit; this is the step for a task whose settlement did not happen: a lost message, a failed
    batch). True when it recorded one."""
    payload = receipt_unsettled(task)
    if payload is None:
        return False
    task_append_event(task=task, event_type="receipt.recorded", actor=actor_of(lease),
                      lease_generation=lease.generation, payload=payload)
    return True


def completion_on_receipt(task: Task, lease: Lease) -> bool:
    """DISPATCHING: deliver the outbox row this run claimed at its intent, if any (direct
    delivery, below); once the receipt is recorded, complete the task with its answer; until then
    the outbox acts. (The outbox completes it when it records the receipt; this step is for a
    receipt recorded without it, or recorded on the action's row and not yet on the task.)"""
    if deliver_directly(task, lease):
        return True
    if receipt_settle(task, lease):
        return True
    event = completion_event(task.state)
    if event is None:
        return False
    task_append_event(task=task, event_type=event[0], actor=actor_of(lease), lease_generation=lease.generation,
                      payload=event[1])
    return False


def deliver_directly(current: Task, lease: Lease) -> bool:
    """Direct delivery (docs/architecture.md §6; :mod:`apps.outbox.direct`): when this run claimed
    its action's outbox row in the intent's transaction (:func:`~apps.agent.intent.direct_delivery_take`),
    commit what the run recorded — the intent, the claimed row, its attempt — send the request
    outside any transaction, and record a new ticket's receipt on the outbox's rows in the run's
    next transaction, which locks the task row, holds it and appends ``receipt.recorded`` there;
    the next step appends ``task.completed`` (:func:`completion_on_receipt`) and the release
    commits with them. An error answer is recorded as a dispatcher records it; a receipt the task
    does not take now (it was cancelled meanwhile) is recorded the one-row way, with δ's refusal.
    ``current`` is the task as the step read it (its device, tenant and requester are reused).
    Returns whether there was a row (the run then reads the task again, unless it holds it).

    An exception while sending is logged, not raised: a request that never left is handed back to
    the dispatcher (:func:`~apps.outbox.direct.direct_give_back`); otherwise the row stays leased
    until its lease expires and a dispatcher claims it with the next fencing token and resends
    with the same key."""
    direct = direct_delivery_take(lease)
    if direct is None:
        return False
    receipt = None
    with checkpoint():
        try:
            receipt = direct_send(direct)
        except Exception:  # noqa: BLE001 - handed back to the dispatcher, or its lease expires
            log.exception("delivering the outbox row %s directly failed", direct.message.pk)
    if receipt is None:
        return True
    recorded = direct_receipt_record(direct, receipt)
    if not recorded.taken:
        with checkpoint():
            receipt_record(action_id=direct.action.pk, receipt=receipt, attempt_id=direct.attempt.pk,
                           actor=f"dispatcher:{direct.owner}")
    elif recorded.payload is not None and recorded.task.lease_generation == lease.generation:
        # The task row is locked and read as it stands: the run holds it, and its receipt.recorded
        # goes in this transaction with the receipt on the outbox's rows (no read of either again).
        open_run().hold_read(recorded.task, generation=lease.generation)
        task = recorded.task
        task.tenant, task.requester, task.device = current.tenant, current.requester, current.device
        task_append_event(task=task, event_type="receipt.recorded", actor=actor_of(lease),
                          lease_generation=lease.generation, payload=recorded.payload)
    return True


def compensation_if_due(task: Task, lease: Lease) -> bool:
    """CANCELLED: record a receipt its action's row holds and the task does not (the ticket was
    created anyway), then ask for the compensation of that ticket, when one is due."""
    if receipt_settle(task, lease):
        return True
    if not compensation_due(task):
        return False
    return compensation_request(task, lease, ticket=created_ticket(task.state["receipt"]))


#: Handlers that run whatever the task's bounds say (a compensation has bounds of its own: its
#: approval's expiry, its re-plan limit and its window).
UNBOUNDED_STEPS = {
    reducer.CANCELLED: compensation_if_due,
    reducer.COMPENSATING: compensate,
}
#: Handlers of a task within its bounds (steps, re-plans, deadline). A status not listed here —
#: WAITING_INPUT, WAITING_RECONCILIATION — waits for someone else to act.
STEPS = {
    reducer.ACCEPTED: retrieval_start,
    reducer.RETRIEVING: lambda task, lease: (reads_step if keeps_plans(task) else context_step)(task, lease),
    reducer.PROPOSING: propose,
    reducer.VALIDATING: validate_and_authorize,
    reducer.WAITING_APPROVAL: resume_after_approval,
    reducer.DISPATCHING: completion_on_receipt,
}
#: an action in flight is finished (receipt or reconciliation) before a bound may end the task
IN_FLIGHT = (reducer.DISPATCHING, reducer.WAITING_RECONCILIATION)


def step(task: Task, lease: Lease) -> bool:
    """Do one step of ``task`` under ``lease`` by the tables above; True when another step should
    follow immediately. A task past a bound (:func:`~apps.agent.common.bounds_exceeded`) fails
    with the reason, unless an action is in flight."""
    if task.status in UNBOUNDED_STEPS:
        return UNBOUNDED_STEPS[task.status](task, lease)
    if task.status in reducer.TERMINAL or task.status == reducer.WAITING_COMPENSATION:
        return False  # a failed compensation waits for a person, whatever the task's deadline
    exceeded = bounds_exceeded(task)
    if exceeded and task.status not in IN_FLIGHT:
        fail(task, lease, exceeded)
        return False
    handler = STEPS.get(task.status)
    return handler(task, lease) if handler is not None else False
