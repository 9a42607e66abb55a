"""Receipts recorded in two halves (DESIGN.md §6, table 16.5 "receipt recorded, before the answer";
docs/architecture.md T10b, T10c): a dispatcher batch's new-ticket receipts on the outbox's own rows
(:func:`receipts_record_batch`), then each task's ``receipt.recorded`` and the ``task.completed`` it
leads to (:func:`receipts_settle`, sent as one ``settle_receipts`` message per batch; the agent's step
for a task whose message was lost: :func:`receipt_unsettled`). A receipt either half cannot take goes
the one-row way, :func:`apps.outbox.settlement.receipt_record`."""

from __future__ import annotations

import logging
import uuid

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from apps.actions.models import Action, ActionStatus
from apps.actions.services import actions_mark_succeeded, attempts_close_with_receipt
from apps.core import sql
from apps.core.queue import RECEIPTS_SETTLE, enqueue_on_commit
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.settlement import _completed_with_receipt, _completion, kick_agent, receipt_record
from apps.tasks import reducer
from apps.tasks.batch import task_events_commit, task_events_prepare
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, refused_after_rollback, task_append_with_retry
from apps.tasks.usage import BudgetExceeded
from apps.tickets.services import mirrors_record_created

log = logging.getLogger(__name__)


def receipts_record_batch(items: list[tuple], *, actor: str) -> None:
    """Record several receipts (``[(action_id, attempt_id, receipt)]``, one per action) on the
    outbox's own rows, in one transaction: per action SUCCEEDED with its receipt, its attempt
    closed, the ticket mirror and the outbox row DELIVERED — all of them or none. An action already
    SUCCEEDED changes nothing. The tasks learn their receipts after the commit: one
    ``settle_receipts`` message for the batch (:func:`receipts_settle`, on the ``agent`` queue)
    appends each task's ``receipt.recorded`` and the ``task.completed`` it leads to (DESIGN.md §6,
    table 16.5 "receipt recorded, before the answer": the receipt is durable, the answer is built
    from it; the lease sweeper re-queues a task whose message was lost).

    A receipt that is not a new ticket (a comment, an update), a compensation's, or one whose task
    would not take it now (not DISPATCHING or CANCELLED, another action, a receipt already there)
    is left out and recorded after the batch by :func:`receipt_record`, with its event in the same
    transaction (and δ's refusal recorded); when the batch itself fails (a lock timeout) it rolls
    back whole and each receipt is recorded alone. A receipt that cannot be recorded alone either is
    logged, not raised: its attempt stays in flight and the row's lease expires, so the next claim
    resends it."""
    if not items:
        return
    try:
        alone = _receipts_record_together(items, actor)
    except DatabaseError as exc:
        log.warning("recording %d receipts together failed (%r); recording them one by one", len(items), exc)
        alone = items
    for action_id, attempt_id, receipt in alone:
        try:
            receipt_record(action_id=action_id, receipt=receipt, attempt_id=attempt_id, actor=actor)
        except Exception:  # noqa: BLE001 - one row must not stop the rest; its lease expires and the
            # next claim resends with the same key, which the remote answers with the stored ticket
            log.exception("recording the receipt of action %s failed", action_id)


_DELIVERED_SQL = """
UPDATE {outbox} SET status = %s, delivered_at = %s, lease_owner = NULL, lease_expires_at = NULL
WHERE action_id = ANY(%s::uuid[])
"""

#: what the tasks of a batch show of their current action, read without the rest of their state's JSON:
#: the tasks in the statuses whose receipts the batch records on the rows alone (δ's statuses for it,
#: WAITING_RECONCILIATION aside: the reconciler records those). The JSON is read in the select list,
#: so only the batch's rows are read from it, whatever plan the tasks' table gets (in the WHERE clause
#: the planner may test it on every task in those statuses before the join: 43 ms a batch at 1,000).
_TAKING_SQL = """
SELECT t.id, t.state -> 'action' ->> 'id', t.state -> 'action' ->> 'status',
       coalesce(t.state -> 'receipt', 'null'::jsonb) = 'null'::jsonb
FROM {task} t WHERE t.id = ANY(%s::uuid[]) AND t.status = ANY(%s)
"""
#: the task statuses whose receipts the batch records on the rows alone (see :data:`_TAKING_SQL`)
_SETTLED_LATER = [reducer.DISPATCHING, reducer.CANCELLED]


def _receipts_record_together(items: list[tuple], actor: str) -> list[tuple]:
    """The transaction of :func:`receipts_record_batch`. Returns the items it left out."""
    now = timezone.now()
    alone = [item for item in items if item[2].kind != "ticket"]
    items = [item for item in items if item[2].kind == "ticket"]
    with transaction.atomic():
        actions = {a.pk: a for a in sql.rows(Action, "t0.id = ANY(%s)", [[i[0] for i in items]],
                                             tail="ORDER BY t0.id FOR UPDATE")}
        items = [item for item in items if actions[item[0]].status != ActionStatus.SUCCEEDED]
        mains = [actions[i[0]] for i in items if actions[i[0]].compensates_id is None]
        taking = set()
        if mains:
            with connection.cursor() as cursor:
                cursor.execute(_TAKING_SQL.format(task=Task._meta.db_table),
                               [[str(a.task_id) for a in mains], _SETTLED_LATER])
                current = {row[0]: row[1:] for row in cursor.fetchall()}
            # A task takes the receipt of its current action, still INTENDED, with no receipt yet.
            taking = {a.task_id for a in mains if _takes(a, current.get(a.task_id))}
        alone += [item for item in items if actions[item[0]].compensates_id is not None
                  or actions[item[0]].task_id not in taking]
        items = [item for item in items if actions[item[0]].compensates_id is None
                 and actions[item[0]].task_id in taking]
        if not items:
            return alone
        receipts_write_rows([(actions[action_id], attempt_id, receipt) for action_id, attempt_id, receipt in items],
                            now=now)
        enqueue_on_commit(RECEIPTS_SETTLE, *sorted(str(actions[i[0]].task_id) for i in items))
    return alone


def receipts_write_rows(items: list[tuple], *, now) -> None:
    """The outbox's half of recording new tickets' receipts, in the caller's transaction, which
    holds the actions locked and has checked each is not SUCCEEDED yet and its task takes the
    receipt: ``items`` is ``[(action, attempt_id or None, receipt)]``. Per action: its attempts
    closed (this one ``RECEIPT``, any other still in flight ``UNKNOWN``), the action SUCCEEDED
    with its receipt (set on the in-memory ``action`` too), its ticket mirror written and its
    outbox row DELIVERED — four statements for all of them. The tasks' ``receipt.recorded`` is
    the caller's to append, after (:func:`receipt_event_payload` is its payload)."""
    ids = [action.pk for action, _, _ in items]
    attempts_close_with_receipt(action_ids=ids, attempt_ids=[a for _, a, _ in items if a is not None], now=now)
    for action, _, receipt in items:
        action.status = ActionStatus.SUCCEEDED
        action.receipt = receipt.as_dict()
        action.external_id = receipt.external_id
        action.external_version = receipt.version
        action.updated_at = now
    actions_mark_succeeded([action for action, _, _ in items], now=now)
    mirrors_record_created([(action, receipt) for action, _, receipt in items], now=now)
    with connection.cursor() as cursor:
        cursor.execute(_DELIVERED_SQL.format(outbox=OutboxMessage._meta.db_table),
                       [OutboxStatus.DELIVERED.value, now, [str(i) for i in ids]])


def receipt_taken_by_locked_task(action: Action) -> tuple[bool, Task | None]:
    """Whether ``action``'s task takes its receipt now — the task is in a status whose receipts are
    recorded on the rows first (DISPATCHING, CANCELLED), its current action is ``action``, still
    INTENDED, and it holds no receipt yet (the batch's rule, :func:`_takes`) — read on the task row
    whole and locked (``FOR NO KEY UPDATE``, in the caller's transaction, after ``action``'s row
    lock: the order every receipt takes). Returns ``(takes it, the task as it stands)``, the task
    None when it is gone: for a caller that appends the task's next events in the same transaction
    (direct delivery) and so needs the row anyway."""
    task = sql.row(Task, "t0.id = %s", [action.task_id], tail="FOR NO KEY UPDATE")
    if task is None:
        return False, None
    current = (task.state or {}).get("action") or {}
    row = (current.get("id"), current.get("status"), (task.state or {}).get("receipt") is None)
    return task.status in _SETTLED_LATER and _takes(action, row), task


def _takes(action: Action, current: tuple | None) -> bool:
    """Whether a task whose current action reads ``current`` (``(id, status, no receipt yet)`` from
    :data:`_TAKING_SQL`) takes ``action``'s receipt: it is that action, still INTENDED, with none."""
    return current == (str(action.pk), "INTENDED", True)


def receipt_event_payload(action: Action) -> dict:
    """The ``receipt.recorded`` payload of ``action``'s receipt as recorded on its row (the batch
    records it there first): its id, the receipt, the cost (its reservation) and when it was
    recorded."""
    return {"action_id": str(action.pk), "receipt": action.receipt, "cost": action.reservation,
            "recorded_at": action.updated_at.isoformat()}


def receipt_unsettled(task: Task) -> dict | None:
    """The ``receipt.recorded`` payload for ``task``'s current action when its row holds a receipt
    the task has not recorded yet (a batch recorded it on the rows, and the task's settlement is
    still to come: :func:`receipts_settle`, or the runner's step), else None. One read of the
    action row, none when the state already holds a receipt or no action."""
    state = task.state or {}
    current = state.get("action")
    if state.get("receipt") is not None or not current:
        return None
    action = sql.row(Action, "t0.id = %s AND t0.status = %s AND t0.compensates_id IS NULL",
                     [current["id"], ActionStatus.SUCCEEDED.value], tenant_id=task.tenant_id)
    return receipt_event_payload(action) if action is not None else None


def receipts_settle(task_ids: list, *, actor: str = "outbox:settle") -> int:
    """Append, to each task of ``task_ids`` whose current action's row holds a receipt it has not
    recorded, ``receipt.recorded`` (settling its budget reservation) and the ``task.completed`` it
    leads to (the answer composed from the recorded state), in one transaction for all of them —
    the second half of :func:`receipts_record_batch`. A task that holds its receipt already is
    passed over, so a repeated message changes nothing. A task not completed by its receipt (a
    cancelled one: its compensation may be due) gets an agent run. When the batch fails (a lost CAS:
    a task moved meanwhile; the tenant's quota; a lock timeout) each task is settled alone with
    CAS retries, and a receipt δ refuses is recorded as refused. Returns how many tasks recorded
    a receipt."""
    ids = [uuid.UUID(str(t)) for t in task_ids]
    if not ids:
        return 0
    try:
        return _receipts_settle_together(ids, actor)
    except (StaleWrite, BudgetExceeded, DatabaseError) as exc:
        log.warning("settling %d receipts together failed (%r); settling them one by one", len(ids), exc)
    settled = 0
    for task_id in ids:
        try:
            settled += receipt_settle_one(task_id, actor=actor)
        except Exception:  # noqa: BLE001 - one task must not stop the rest; the sweeper re-queues it
            log.exception("settling the receipt of task %s failed", task_id)
    return settled


def _receipts_settle_together(ids: list[uuid.UUID], actor: str) -> int:
    with transaction.atomic():
        actions = {a.task_id: a for a in sql.rows(
            Action, "t0.task_id = ANY(%s) AND t0.status = %s AND t0.compensates_id IS NULL",
            [ids, ActionStatus.SUCCEEDED.value])}

        def payload_for(action):
            def payload(task):
                current = (task.state or {}).get("action") or {}
                if task.state.get("receipt") is not None and current.get("id") == str(action.pk):
                    return None  # settled already (a repeated message, or the runner's step)
                return receipt_event_payload(action)
            return payload

        prepared, refused = task_events_prepare(
            [(task_id, "receipt.recorded", payload_for(actions[task_id]), actor) for task_id in ids
             if task_id in actions], then=_completion)
        task_events_commit(prepared)
        for p in prepared:
            if not p.follow:  # not completed with its receipt (a cancelled task): the agent acts
                kick_agent(p.task.pk)
    for task_id, event_type, payload, reason in refused:
        if payload is not None:
            refused_after_rollback(task_id=task_id, event_type=event_type, payload=payload, reason=reason, actor=actor)
            log.error("receipt for task %s refused: %s", task_id, reason)
    return len(prepared)


def receipt_settle_one(task_id, *, actor: str) -> int:
    """:func:`receipts_settle` for one task, with CAS retries: 1 when it recorded the receipt,
    0 when there was none to record (or δ refused it: recorded as refused)."""
    with transaction.atomic():
        task = Task.objects.select_for_update().get(pk=task_id)  # so no other writer settles it meanwhile
        payload = receipt_unsettled(task)
        if payload is None:
            return 0
        try:
            task = task_append_with_retry(task_id=task_id, event_type="receipt.recorded", actor=actor,
                                          payload_fn=lambda t: payload)
        except reducer.IllegalTransition as exc:
            log.error("receipt for task %s refused: %s", task_id, exc.reason)
            return 0
        if not _completed_with_receipt(task, actor):
            kick_agent(task_id)
    return 1
