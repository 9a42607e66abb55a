"""Direct delivery (docs/architecture.md §6, "Direct delivery"; DESIGN.md §1 steps 6–8, §6): the run
that commits a new ticket's intent delivers the outbox row itself, instead of handing it to a
dispatcher and the receipt back to the agent (two Celery hops, a claim, a batch of one).

Nothing is skipped that a dispatcher does; the steps only move:

1. the intent's transaction writes the row already claimed by the run's process
   (:func:`~apps.outbox.services.outbox_enqueue` with ``deliver_by``: ``IN_FLIGHT``, leased,
   fencing token 1) and the attempt row (:func:`direct_attempt_open`) — durable in one commit
   before any request;
2. after that commit, outside any transaction, the re-authorization at the moment of dispatch
   (:func:`~apps.outbox.dispatch.preflight`, on the task's status read once every cancel already
   begun has ended: :mod:`apps.tasks.cancel_gate`), then the request with the action's
   idempotency key and the row's fencing token; an error answer is recorded exactly as a
   dispatcher records it (:func:`direct_send`);
3. the receipt goes on the outbox's rows in the run's next transaction
   (:func:`direct_receipt_record`), where the run appends ``receipt.recorded`` and
   ``task.completed`` and gives its lease back: one commit.

A run that dies anywhere leaves the row ``IN_FLIGHT`` under a lease that expires; a dispatcher then
claims it with the next fencing token and resends with the same key (the ticket system replays the
ticket, or fences the old token out), as for a dispatcher that died. A row for a ticket system
without idempotency gets no attempt at its intent and goes the one-row path after the commit
(:func:`~apps.outbox.dispatch.outbox_deliver`, which looks the key up before any resend); so does a
row whose re-authorization does not say "send" (a cancel, an approval no longer bound), after its
unsent attempt is closed as not sent."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from django.db import connection, transaction
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.actions.services import attempts_start
from apps.core import sql
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.core.queue import OUTBOX_DISPATCH, kick_on_commit
from apps.outbox.dispatch import outbox_deliver, preflight
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.receipts import receipt_event_payload, receipt_taken_by_locked_task, receipts_write_rows
from apps.outbox.sending import request_timeout
from apps.outbox.settlement import attempt_error_record, receipt_record, still_ours
from apps.tasks.cancel_gate import cancels_in_flight_wait
from apps.tasks.models import Task
from apps.tickets.connectors import Receipt, connector_for
from config.logs import bind

log = logging.getLogger(__name__)


@dataclass
class DirectSend:
    """A row claimed at its intent whose attempt is written: the row (its ``lease_generation`` the
    fencing token), its action and task, the parameters to send (set by the re-authorization), the
    attempt row, the lease owner."""

    message: OutboxMessage
    action: Action
    task: Task
    params: dict | None
    attempt: ActionAttempt
    owner: str


def direct_attempt_open(*, message: OutboxMessage, action: Action, task: Task, owner: str) -> DirectSend | None:
    """Step 1's second half, in the intent's transaction (the caller's), for ``message`` just
    written claimed by ``owner``, its first attempt counted
    (:func:`~apps.outbox.services.outbox_enqueue`): write that attempt row (number 1, the row's
    fencing token). Returns the :class:`DirectSend`. A ticket system without idempotency (whose key
    a dispatcher looks up before any resend) is never delivered directly: its row is handed to the
    dispatcher in the same transaction (unleased, due now, kicked on commit) and
    None is returned. Raises what the database raises."""
    if not connector_for(action.tool, action.connector).idempotent_by_key:
        OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.PENDING, lease_owner=None,
                                                           lease_expires_at=None, attempts=0)
        message.attempts = 0
        kick_on_commit(OUTBOX_DISPATCH)
        return None
    attempt = attempts_start([(action, message.lease_generation)], worker=owner, now=timezone.now())[action.pk]
    if message.attempts != attempt.number:  # the row was written counting this first attempt
        OutboxMessage.objects.filter(pk=message.pk).update(attempts=attempt.number)
        message.attempts = attempt.number
    return DirectSend(message=message, action=action, task=task, params=None, attempt=attempt, owner=owner)


#: the task's status and cancel flag, without the rest of its state's JSON
_TASK_NOW_SQL = """
SELECT status, coalesce((state ->> 'cancel_requested')::boolean, false) FROM {task} WHERE id = %s
"""


def direct_give_back(send: DirectSend, reason: str) -> bool:
    """Hand a row claimed at its intent whose request never left to the dispatcher, in one
    transaction of its own (after the intent's commit: the run ended before its request, or its
    re-authorization could not be read): its attempt closed ``SKIPPED`` with ``reason`` — this
    process knows it was never sent, so it never counts as "may have reached the remote" — and the
    row ``PENDING``, unleased and due now, with a dispatcher kick on commit. Nothing when the row
    is no longer held at its fencing token (a dispatcher took it over: it owns the row now).
    Returns whether the row was handed over. Raises what the database raises."""
    with transaction.atomic():
        if not still_ours(send.message.pk, send.message.lease_generation).exists():
            return False
        ActionAttempt.objects.filter(pk=send.attempt.pk, outcome=AttemptOutcome.IN_FLIGHT).update(
            outcome=AttemptOutcome.SKIPPED, error={"code": "not_sent", "detail": reason}, finished_at=timezone.now())
        OutboxMessage.objects.filter(pk=send.message.pk).update(status=OutboxStatus.PENDING, lease_owner=None,
                                                                lease_expires_at=None, available_at=timezone.now())
        kick_on_commit(OUTBOX_DISPATCH)
    return True


def _authorized_now(send: DirectSend):
    """:func:`~apps.outbox.dispatch.preflight` for ``send`` after the intent's commit, on the task's
    status as it stands once every cancel already begun has ended (:mod:`apps.tasks.cancel_gate`):
    a cancel issued while the run's transaction held the task row waited for that lock, which the
    very commit before the request released — it is committed first and seen here."""
    task = copy.copy(send.task)
    cancels_in_flight_wait(task.pk)
    with connection.cursor() as cursor:
        cursor.execute(_TASK_NOW_SQL.format(task=Task._meta.db_table), [task.pk])
        task.status, cancel_requested = cursor.fetchone()
    return preflight(send.message, send.action, task, now=timezone.now(), cancel_requested=cancel_requested)


def direct_send(send: DirectSend) -> Receipt | None:
    """Step 2, outside any transaction (the intent and the attempt row are committed): the
    re-authorization at the moment of dispatch (:func:`_authorized_now`) — when it does not say
    "send", the attempt is closed as not sent and the row goes the one-row path
    (:func:`~apps.outbox.dispatch.outbox_deliver`: a cancel recorded as not sent, an approval
    invalidated) — then the request with the action's stable idempotency key and the row's
    fencing token, its timeout bounded by the task's deadline. An error answer is recorded as a dispatcher records it
    (:func:`~apps.outbox.settlement.attempt_error_record`: unknown, retry with backoff, failure),
    and a receipt that is not a new ticket is recorded the one-row way
    (:func:`~apps.outbox.settlement.receipt_record`); both return None. Returns a new ticket's
    receipt, for :func:`direct_receipt_record`."""
    action, message = send.action, send.message
    bind(tenant_id=action.tenant_id, task_id=action.task_id, action_id=action.pk, outbox_id=message.pk,
         fencing_token=message.lease_generation, attempt=send.attempt.number, step="dispatch:direct")
    try:
        check = _authorized_now(send)
    except Exception:
        # e.g. a lock timeout: nothing was sent, and the dispatcher re-authorizes when it claims the row
        _give_back_or_log(send, "the re-authorization before the request failed")
        raise
    if check.kind != "send":
        # Not sent, and this process knows it: the attempt is closed as such, and the one-row path
        # records why (not executed: nothing of the action can have reached the remote).
        ActionAttempt.objects.filter(pk=send.attempt.pk, outcome=AttemptOutcome.IN_FLIGHT).update(
            outcome=AttemptOutcome.SKIPPED, error={"code": "not_sent", "detail": check.reason or check.kind},
            finished_at=timezone.now())
        outcome = outbox_deliver(message_id=message.pk, fencing_token=message.lease_generation, owner=send.owner)
        log.info("direct delivery of %s: %s before the request (%s)", message.pk, outcome, check.kind)
        return None
    send.params = check.params
    failpoint("before_send")
    try:
        receipt = connector_for(action.tool, action.connector).execute(
            tool=action.tool, idempotency_key=action.idempotency_key, fencing_token=message.lease_generation,
            params=send.params, timeout=request_timeout(action, send.task))
    except errors.ToolError as exc:
        outcome = attempt_error_record(message, action, send.attempt, send.task, exc, message.lease_generation,
                                       send.owner)
        log.info("direct delivery of %s: %s", message.pk, outcome)
        return None
    failpoint("after_send")
    if receipt.kind != "ticket":
        receipt_record(action_id=action.pk, receipt=receipt, attempt_id=send.attempt.pk,
                       actor=f"dispatcher:{send.owner}")
        return None
    return receipt


def _give_back_or_log(send: DirectSend, reason: str) -> None:
    try:
        direct_give_back(send, reason)
    except Exception:  # noqa: BLE001 - the row's lease expires and a dispatcher takes it over anyway
        log.exception("handing the outbox row %s back to the dispatcher failed", send.message.pk)


@dataclass
class DirectRecorded:
    """What :func:`direct_receipt_record` did: ``taken`` False when the task does not take the
    receipt now (the caller records it after its commit); ``task`` the task row as it stands,
    locked by the caller's transaction (None when it was not read: a dispatcher had recorded the
    receipt already); ``payload`` the task's ``receipt.recorded`` payload when this call wrote the
    receipt on the rows (None otherwise)."""

    taken: bool
    task: Task | None = None
    payload: dict | None = None


def direct_receipt_record(send: DirectSend, receipt: Receipt) -> DirectRecorded:
    """Step 3's first half, in the caller's transaction (the run's, which appends the task's
    ``receipt.recorded`` next with the returned payload): lock the action; unless it is SUCCEEDED
    already (a dispatcher that took the row over recorded it), lock and read the task row
    (:func:`~apps.outbox.receipts.receipt_taken_by_locked_task`) and, when the task takes the
    receipt now, write it on the outbox's rows (:func:`~apps.outbox.receipts.receipts_write_rows`).
    ``taken`` False when the task does not take it (cancelled meanwhile, another action current):
    the caller records it after its commit with :func:`~apps.outbox.settlement.receipt_record`,
    where δ's refusal is recorded. Raises what the database raises."""
    action = sql.row(Action, "t0.id = %s", [send.action.pk], tail="FOR UPDATE")
    if action.status == ActionStatus.SUCCEEDED:
        return DirectRecorded(taken=True)
    takes, task = receipt_taken_by_locked_task(action)
    if not takes:
        return DirectRecorded(taken=False, task=task)
    receipts_write_rows([(action, send.attempt.pk, receipt)], now=timezone.now())
    return DirectRecorded(taken=True, task=task, payload=receipt_event_payload(action))
