"""Settlement of an outbox row (DESIGN.md §6, §7; spec §16.4, table 16.5): the receipt (action
SUCCEEDED, ticket mirror, outbox DELIVERED and the task's ``receipt.recorded`` in one transaction),
"not executed" only when it is known — no attempt can have reached the remote, or the key was
first fenced at the remote with the row's current fencing token and nothing was found — the
outcome events a dispatcher or reconciler records on the task, and what an attempt's error answer
leads to (:func:`attempt_error_record`: unknown, a retry with backoff, a conflict, or a failure)."""

from __future__ import annotations

import logging
import random
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Max
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.actions.registry import tool_get
from apps.actions.services import actions_mark_succeeded, attempts_close_with_receipt
from apps.approvals.services import approval_invalidate
from apps.core import sql
from apps.core import tool_errors as errors
from apps.core.queue import AGENT_STEP, RECEIPTS_SETTLE, enqueue_on_commit
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks import reducer
from apps.tasks.answer import completion_event
from apps.tasks.batch import task_events_commit, task_events_prepare
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, refused_after_rollback, task_append_event, task_append_with_retry
from apps.tasks.usage import BudgetExceeded
from apps.tickets.connectors import Receipt, connector_for
from apps.tickets.models import TicketMirror
from apps.tickets.services import mirrors_record_created

log = logging.getLogger(__name__)


def kick_agent(task_id) -> None:

    enqueue_on_commit(AGENT_STEP, task_id)


def append_or_record_refusal(*, task_id, event_type: str, actor: str, payload_fn) -> bool:
    """Append an event for the task from inside the caller's transaction. When δ refuses it (a
    late outcome on a terminal task) the refusal is already recorded as a ``RefusedEvent`` in
    that same transaction, which still commits the caller's row updates: the facts about the
    remote are kept, the task does not change. Returns whether the event was applied."""
    try:
        task_append_with_retry(task_id=task_id, event_type=event_type, actor=actor, payload_fn=payload_fn)
    except reducer.IllegalTransition as exc:
        log.warning("task %s refused %s: %s", task_id, event_type, exc.reason)
        return False
    return True


def may_have_executed(action_id, *, except_attempt_id=None) -> bool:
    """True when an attempt of the action may have reached the remote: it is still in flight (its
    dispatcher died or stalls) or ended without an answer. Attempts that ended with a definite
    answer (receipt, refusal, not delivered) do not count."""
    attempts = ActionAttempt.objects.filter(action_id=action_id,
                                            outcome__in=[AttemptOutcome.IN_FLIGHT, AttemptOutcome.UNKNOWN])
    if except_attempt_id is not None:
        attempts = attempts.exclude(pk=except_attempt_id)
    return attempts.exists()


class NotYetProvable(errors.TemporarilyUnavailable):
    """The ticket system cannot fence, and an unanswered request of the action may still take
    effect until ``provable_at`` (its start + the connector's request lifetime)."""

    code = "not_yet_provable"

    def __init__(self, provable_at):
        super().__init__(f"an unanswered request may still take effect until {provable_at.isoformat()}")
        self.provable_at = provable_at


def fence(action: Action, token: int):
    """Make "nothing found by key" final, then look the key up (ADR 0009). Where the ticket system
    can fence a key, fence it at ``token``. Where it cannot (django-helpdesk), wait until every
    unanswered attempt is older than the connector's request lifetime, then look up. Returns the
    ticket as a :class:`Receipt` or None; raises :class:`NotYetProvable` or the connector's
    :class:`~apps.actions.errors.ToolError`."""
    connector = connector_for(action.tool, action.connector)
    if not connector.supports_fence:
        newest = ActionAttempt.objects.filter(
            action_id=action.pk, outcome__in=[AttemptOutcome.IN_FLIGHT, AttemptOutcome.UNKNOWN]
        ).aggregate(newest=Max("started_at"))["newest"]
        if newest is not None:
            provable_at = newest + timedelta(seconds=connector.request_lifetime_seconds)
            if timezone.now() < provable_at:
                raise NotYetProvable(provable_at)
    return connector.fence(idempotency_key=action.idempotency_key, fencing_token=token)


def settle_not_executed(message, action, fencing_token: int, actor: str, *, except_attempt_id=None) -> str | None:
    """Establish that the action was not executed before anyone records so (DESIGN.md §6).

    Returns None when "not executed" is proven: no attempt may have reached the remote, or the
    key, fenced at the remote with this dispatcher's ``fencing_token``, has no ticket — and no
    older token can create one any more. Otherwise returns the outcome already recorded here:
    ``"receipt"`` (the ticket exists: a late effect of an earlier attempt, recorded as the
    receipt), ``"undecided"`` (the remote could not be asked: the row goes back to PENDING with
    backoff and the next claim asks again) or ``"lost_lease"``."""
    if not may_have_executed(action.pk, except_attempt_id=except_attempt_id):
        return None
    try:
        found = fence(action, fencing_token)
    except errors.ToolError as exc:
        with transaction.atomic():
            if not still_ours(message.pk, fencing_token).exists():
                return "lost_lease"
            now = timezone.now()
            retry_at = now + timedelta(seconds=backoff_delay(message.attempts))
            if isinstance(exc, NotYetProvable):
                retry_at = max(retry_at, exc.provable_at)
            OutboxMessage.objects.filter(pk=message.pk).update(
                status=OutboxStatus.PENDING, available_at=retry_at,
                last_error={**exc.as_dict(), "while": "fencing before recording not executed"},
                lease_owner=None, lease_expires_at=None,
            )
        return "undecided"
    if found is None:
        return None
    receipt_record(action_id=action.pk, receipt=found, actor=actor)
    return "receipt"


def finish_not_sent(message, action, fencing_token, status, reason, actor="dispatcher") -> None:
    with transaction.atomic():
        if not still_ours(message.pk, fencing_token).exists():
            return
        Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT, last_error={"reason": reason})
        OutboxMessage.objects.filter(pk=message.pk).update(status=status, last_error={"reason": reason},
                                                           lease_owner=None, lease_expires_at=None)
        append_or_record_refusal(
            task_id=action.task_id, event_type="dispatch.failed", actor=actor,
            payload_fn=lambda t: {"action_id": str(action.pk), "error": reason, "executed": False},
        )


def receipt_record(*, action_id, receipt: Receipt, attempt_id=None, actor: str, resolution: dict | None = None) -> None:
    """Record a receipt (DESIGN.md §1 step 8): action SUCCEEDED, ticket mirror, outbox DELIVERED
    and the task's ``receipt.recorded`` event (settling the budget reservation) in one
    transaction, with the ``task.completed`` it leads to (the answer composed from the recorded
    state) when it completes the task; otherwise the agent is kicked to act on it. Idempotent: a
    second receipt for the same action changes nothing. ``resolution`` (a person's reconciliation:
    who, why, verified how) is recorded in the event payload."""
    try:
        _receipt_record(action_id=action_id, receipt=receipt, attempt_id=attempt_id, actor=actor,
                        resolution=resolution)
    except reducer.IllegalTransition as exc:
        # The whole recording rolled back with the refusal; keep the record of what δ refused.
        task_id = Action.objects.filter(pk=action_id).values_list("task_id", flat=True).get()
        refused_after_rollback(task_id=task_id, event_type="receipt.recorded", payload={
            "action_id": str(action_id), "receipt": receipt.as_dict()}, reason=exc.reason, actor=actor)
        log.error("receipt for action %s refused: %s", action_id, exc.reason)


def _receipt_record(*, action_id, receipt: Receipt, attempt_id=None, actor: str, resolution=None) -> None:
    now = timezone.now()
    with transaction.atomic():
        action = Action.objects.select_for_update().get(pk=action_id)
        if action.status == ActionStatus.SUCCEEDED:
            return
        # Attempts whose dispatcher never reported (died or stalls): one of them may be the one
        # that created the ticket, none is still "in flight" for the record.
        attempts_close_with_receipt(action_ids=[action_id], attempt_ids=[attempt_id] if attempt_id is not None else [],
                                    now=now)
        action.status = ActionStatus.SUCCEEDED
        action.receipt = receipt.as_dict()
        action.external_id = receipt.external_id
        action.external_version = receipt.version
        action.save(update_fields=["status", "receipt", "external_id", "external_version", "updated_at"])
        if receipt.kind == "ticket":
            TicketMirror.objects.update_or_create(
                action=action,
                defaults={"tenant_id": action.tenant_id, "connector": receipt.connector,
                          "external_id": receipt.external_id, "external_version": receipt.version,
                          "status": receipt.status, "data": receipt.body},
            )
        else:
            # A comment or update on an existing ticket: the ticket's mirror learns its new version
            # (and, for an update, its status), never going backwards.
            changes = {"external_version": receipt.version}
            if receipt.kind == "update":
                changes.update(status=receipt.status, data=receipt.body)
            TicketMirror.objects.filter(tenant_id=action.tenant_id, connector=receipt.connector,
                                        external_id=receipt.ticket_id,
                                        external_version__lt=receipt.version).update(**changes)
        OutboxMessage.objects.filter(action=action).update(status=OutboxStatus.DELIVERED, delivered_at=now,
                                                            lease_owner=None, lease_expires_at=None)
        task = task_append_with_retry(
            task_id=action.task_id, event_type="receipt.recorded", actor=actor,
            payload_fn=lambda t: {"action_id": str(action.pk), "receipt": receipt.as_dict(),
                                  "cost": action.reservation, "recorded_at": now.isoformat(),
                                  **({"resolution": resolution} if resolution else {})},
        )
        if not _completed_with_receipt(task, actor):
            kick_agent(action.task_id)


def _completed_with_receipt(task, actor: str) -> bool:
    """Append ``task.completed`` (the answer composed from the recorded state, which holds the
    receipt) in the receipt's own transaction when the receipt completes the task
    (:func:`~apps.tasks.answer.completion_event`): the answer says "created" in the commit that
    makes the receipt durable, and no agent run is needed for it. Returns whether it did; when it
    did not (a cancelled task, a compensation), the caller kicks the agent."""
    event = _completion(task, task.state)
    if event is None:
        return False
    try:
        task_append_event(task=task, event_type=event[0], payload=event[1], actor=actor)
    except reducer.IllegalTransition:
        return False  # recorded as refused; the receipt stands and the agent decides
    return True


def _completion(task, state: dict) -> tuple[str, dict] | None:
    """:func:`~apps.tasks.answer.completion_event` for a receipt's transaction — where nothing may
    cost the receipt its commit: an answer that cannot be composed is logged and left to the
    agent's completion step, which meets the same error there, with the receipt recorded."""
    try:
        return completion_event(state)
    except Exception:  # noqa: BLE001 - the receipt must be recorded whatever the answer does
        log.exception("composing the answer of task %s with its receipt failed; the agent completes it", task.pk)
        return None


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

#: the tasks that take a receipt for ``action`` now, read without their state's JSON: DISPATCHING or
#: CANCELLED (δ's statuses for it, WAITING_RECONCILIATION aside: the reconciler records those),
#: ``action`` their current action and still INTENDED (not UNKNOWN: the reconciler's), and no receipt yet
_TAKING_SQL = """
SELECT t.id FROM {task} t JOIN unnest(%s::uuid[], %s::uuid[]) AS v(task_id, action_id) ON t.id = v.task_id
WHERE t.status = ANY(%s) AND t.state -> 'action' ->> 'id' = v.action_id::text
  AND t.state -> 'action' ->> 'status' = 'INTENDED'
  AND coalesce(t.state -> 'receipt', 'null'::jsonb) = 'null'::jsonb
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
                               [[str(a.task_id) for a in mains], [str(a.pk) for a in mains], _SETTLED_LATER])
                taking = {row[0] for row in cursor.fetchall()}
        alone += [item for item in items if actions[item[0]].compensates_id is not None
                  or actions[item[0]].task_id not in taking]
        items = [item for item in items if actions[item[0]].compensates_id is None
                 and actions[item[0]].task_id in taking]
        if not items:
            return alone
        ids = [action_id for action_id, _, _ in items]
        attempt_ids = [attempt_id for _, attempt_id, _ in items if attempt_id is not None]
        attempts_close_with_receipt(action_ids=ids, attempt_ids=attempt_ids, now=now)
        changed = []
        for action_id, _, receipt in items:
            action = actions[action_id]
            action.status = ActionStatus.SUCCEEDED
            action.receipt = receipt.as_dict()
            action.external_id = receipt.external_id
            action.external_version = receipt.version
            action.updated_at = now
            changed.append(action)
        actions_mark_succeeded(changed, now=now)
        mirrors_record_created([(actions[action_id], receipt) for action_id, _, receipt in items], now=now)
        with connection.cursor() as cursor:
            cursor.execute(_DELIVERED_SQL.format(outbox=OutboxMessage._meta.db_table),
                           [OutboxStatus.DELIVERED.value, now, [str(i) for i in ids]])
        enqueue_on_commit(RECEIPTS_SETTLE, *sorted(str(actions[i].task_id) for i in ids))
    return alone


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


BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 60.0


def backoff_delay(attempt: int, *, rng: random.Random | None = None) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base · 2^attempt)) seconds, with
    the base from ``FAULTDESK["RETRY_BACKOFF_BASE_SECONDS"]`` (default 1 s)."""
    rng = rng or random.Random()  # noqa: S311 - jitter, not security
    base = settings.FAULTDESK.get("RETRY_BACKOFF_BASE_SECONDS", BACKOFF_BASE_SECONDS)
    return rng.uniform(0, min(BACKOFF_CAP_SECONDS, base * (2**attempt)))


def still_ours(message_id, fencing_token: int):
    """The outbox row ``message_id``, locked, while its fencing token is still ``fencing_token``
    (empty once another dispatcher claimed it)."""
    return OutboxMessage.objects.select_for_update().filter(pk=message_id, lease_generation=fencing_token)


#: attempts of one outbox row before its action is recorded as failed
MAX_ATTEMPTS = 8


def action_deadline(action: Action, task: Task):
    """When sending (and re-sending) ``action`` must stop: the task's deadline, or for a
    compensation — which runs after its task was cancelled — its own window of
    ``TASK_DEADLINE_SECONDS`` from its intent."""
    if action.compensates_id is None:
        return task.deadline_at
    return action.created_at + timedelta(seconds=settings.FAULTDESK["TASK_DEADLINE_SECONDS"])


def attempt_error_record(message, action, attempt, task, exc: errors.ToolError, fencing_token, owner) -> str:
    """Record the error ``exc`` of this dispatcher's attempt: ``"unknown"`` (sent, unanswered:
    the reconciler looks it up), ``"retry"`` (a retryable refusal: PENDING with backoff),
    ``"failed"`` (definite, and not executed — proven first by :func:`settle_not_executed` when
    an earlier attempt may have reached the remote), or, for a dispatcher that lost its lease,
    ``"lost_lease"`` with only its attempt row closed."""
    now = timezone.now()
    actor = f"dispatcher:{owner}"
    err = exc.as_dict()
    unknown = isinstance(exc, errors.OutcomeUnknown) or (
        isinstance(exc, errors.PreconditionFailed) and exc.body.get("error") == "stale_fencing_token"
    )
    # A retryable error means this request did nothing; a resend to a ticket system without
    # idempotency first looks the key up (see outbox_deliver), so both kinds may retry.
    retry_ok = exc.retryable and message.attempts < MAX_ATTEMPTS and action_deadline(action, task) > now
    if not unknown and not retry_ok:
        # About to record "not executed": an earlier attempt may still have created the ticket.
        settled = settle_not_executed(message, action, fencing_token, actor, except_attempt_id=attempt.pk)
        if settled is not None:
            # This attempt's own answer was definite; the action's outcome was settled above.
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.FAILED, error=err,
                                                               finished_at=now)
            return settled
    with transaction.atomic():
        # A dispatcher whose lease on the row passed to another (or whose action already has its
        # receipt) records nothing: the current holder owns the outcome.
        if not still_ours(message.pk, fencing_token).exists():
            # A definite answer (e.g. 409: an older token) means this request did nothing.
            outcome = AttemptOutcome.FAILED if exc.executed is False else AttemptOutcome.UNKNOWN
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=outcome, error=err, finished_at=now)
            return "lost_lease"
        if Action.objects.filter(pk=action.pk, status=ActionStatus.SUCCEEDED).exists():
            outcome = AttemptOutcome.FAILED if exc.executed is False else AttemptOutcome.UNKNOWN
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=outcome, error=err, finished_at=now)
            return "already_done"
        if unknown:
            # Sent and unanswered — or a newer dispatcher holds this key: either way the effect may
            # exist. Never a new logical request: the reconciler looks it up by key.
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.UNKNOWN, error=err,
                                                               finished_at=now)
            Action.objects.filter(pk=action.pk).update(status=ActionStatus.UNKNOWN, last_error=err)
            OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.UNKNOWN, last_error=err,
                                                               lease_owner=None, lease_expires_at=None)
            append_or_record_refusal(task_id=task.pk, event_type="outcome.unknown", actor=actor,
                                      payload_fn=lambda t: {"action_id": str(action.pk), "error": err})
            return "unknown"
        if retry_ok:
            delay = backoff_delay(message.attempts)
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.RETRYABLE, error=err,
                                                               finished_at=now)
            OutboxMessage.objects.filter(pk=message.pk).update(
                status=OutboxStatus.PENDING, available_at=now + timedelta(seconds=delay), last_error=err,
                lease_owner=None, lease_expires_at=None,
            )
            return "retry"
        if conflict_answered(action, exc):
            # 412: the ticket moved on since the plan read it. Not executed (the key never wrote):
            # the task re-reads the ticket and re-plans, under a new approval.
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.FAILED, error=err,
                                                               finished_at=now)
            Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT, last_error=err)
            OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.FAILED, last_error=err,
                                                               lease_owner=None, lease_expires_at=None)
            if action.approval is not None:
                approval_invalidate(approval=action.approval, reason="the ticket changed since the approval (412)")
            append_or_record_refusal(task_id=task.pk, event_type="dispatch.conflict", actor=actor,
                                      payload_fn=lambda t: {"action_id": str(action.pk),
                                                            "expected_version": action.params.get("if_match"),
                                                            "current_version": exc.body.get("current_version"),
                                                            "executed": False})
            kick_agent(task.pk)
            return "conflict"
        ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.FAILED, error=err, finished_at=now)
        Action.objects.filter(pk=action.pk).update(status=ActionStatus.FAILED, last_error=err)
        OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.FAILED, last_error=err,
                                                           lease_owner=None, lease_expires_at=None)
        append_or_record_refusal(task_id=task.pk, event_type="dispatch.failed", actor=actor,
                                  payload_fn=lambda t: {"action_id": str(action.pk), "error": err["code"],
                                                        "detail": err["detail"], "executed": False})
    return "failed"


def conflict_answered(action: Action, exc: errors.ToolError) -> bool:
    """A conditional write refused because the ticket is no longer at the version it was planned on
    (412), or no longer exists (404): either way nothing was written and the plan is stale."""
    if not (tool_get(action.tool).conditional and isinstance(exc, errors.PreconditionFailed)):
        return False
    return (exc.status, exc.body.get("error")) in ((412, "version_mismatch"), (404, "not_found"))
