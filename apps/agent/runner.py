"""The step table (DESIGN.md §1, §5): :func:`agent_run` takes the lease and, while the task can move
on, runs the handler for its recorded status; :func:`context_read` runs the reads on the ``tools``
queue. Each handler returns True when another step should follow at once. The runner is re-entrant:
it looks at the recorded state and does the next thing, so a crash anywhere resumes from the last
event."""

from __future__ import annotations

import logging
import uuid

from apps.agent.authorization import (
    resume_after_approval,
    validate_and_authorize,
)
from apps.agent.common import (
    MAX_STEPS_PER_RUN,
    actor_of,
    bounds_exceeded,
    fail,
    has_ledger,
    release_stale,
)
from apps.agent.compensation import compensate, compensation_due, compensation_request, created_ticket
from apps.agent.drafting import propose
from apps.core.queue import READ_CONTEXT, enqueue_on_commit
from apps.tasks import reducer
from apps.tasks.answer import answer_compose
from apps.tasks.leases import Lease, task_claim, task_release
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, task_append_event
from apps.tasks.usage import BudgetExceeded
from config.logs import bind

log = logging.getLogger(__name__)


def agent_run(*, task_id: uuid.UUID) -> None:
    """Run the agent's next steps for ``task_id`` until it waits, ends or hands work to another
    queue. Returns quietly when another worker holds the lease or the task is terminal."""
    lease = task_claim(task_id=task_id)
    if lease is None:
        return
    try:
        task = Task.objects.get(pk=task_id)
        bind(tenant_id=task.tenant_id, task_id=task.pk, lease_generation=lease.generation, step="agent_run")
        if has_ledger(task):
            release_stale(task, lease)
        for _ in range(MAX_STEPS_PER_RUN):
            task = Task.objects.select_related("device", "tenant", "requester").get(pk=task_id)
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
        log.info("agent_run lost the lease on %s", task_id)
    except reducer.IllegalTransition as exc:
        # Already recorded as a refused event; the task stays as it was.
        log.warning("agent_run on %s: %s", task_id, exc)
    finally:
        task_release(lease=lease)
    # Hand retrieval to the tools queue only now that the lease is free for its worker to claim.
    if Task.objects.filter(pk=task_id, status=reducer.RETRIEVING).exists():
        enqueue_on_commit(READ_CONTEXT, task_id)


def retrieval_start(task: Task, lease: Lease) -> bool:
    """ACCEPTED: record ``retrieval.started``; :func:`agent_run` hands RETRIEVING to the tools
    queue once the lease is free for its worker to claim."""
    task_append_event(task=task, event_type="retrieval.started", actor=actor_of(lease),
                      lease_generation=lease.generation, payload={})
    return False


def completion_on_receipt(task: Task, lease: Lease) -> bool:
    """DISPATCHING: once the receipt is recorded, complete the task with its answer; until then
    the outbox acts."""
    receipt = task.state["receipt"]
    if receipt is None:
        return False
    reason = "ticket_commented" if receipt.get("kind") == "comment" else "ticket_created"
    task_append_event(task=task, event_type="task.completed", actor=actor_of(lease), lease_generation=lease.generation,
                      payload={"reason": reason, "answer": answer_compose(task.state)})
    return False


def compensation_if_due(task: Task, lease: Lease) -> bool:
    """CANCELLED: ask for the compensation of a ticket created anyway, when one is due."""
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
#: RETRIEVING, WAITING_INPUT, WAITING_RECONCILIATION — waits for someone else to act.
STEPS = {
    reducer.ACCEPTED: retrieval_start,
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
