"""Direct delivery (docs/architecture.md §6, "Direct delivery"; DESIGN.md §1 steps 6–8, §6): the run
that commits a new ticket's intent delivers the outbox row itself, instead of handing it to a
dispatcher and the receipt back to the agent (two Celery hops, a claim, a batch of one).

Nothing is skipped that a dispatcher does; the steps only move:

1. the intent's transaction writes the row already claimed by the run's process
   (:func:`~apps.outbox.services.outbox_enqueue` with ``deliver_by``: ``IN_FLIGHT``, leased,
   fencing token 1), re-authorizes it at once (:func:`~apps.outbox.dispatch.preflight`) and writes
   the attempt row (:func:`direct_attempt_open`) — all durable in one commit before any request;
2. outside any transaction, the request with the action's idempotency key and the row's fencing
   token; an error answer is recorded exactly as a dispatcher records it (:func:`direct_send`);
3. the receipt goes on the outbox's rows in the run's next transaction
   (:func:`direct_receipt_record`), where the run appends ``receipt.recorded`` and
   ``task.completed`` and gives its lease back: one commit.

A run that dies anywhere leaves the row ``IN_FLIGHT`` under a lease that expires; a dispatcher then
claims it with the next fencing token and resends with the same key (the ticket system replays the
ticket, or fences the old token out), as for a dispatcher that died. A row whose re-authorization
does not say "send" at once (a ticket system without idempotency, an approval no longer bound) is
delivered by :func:`~apps.outbox.dispatch.outbox_deliver` after the commit, the one-row path."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, ActionStatus
from apps.actions.services import attempts_start
from apps.core import sql
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.outbox.dispatch import preflight
from apps.outbox.models import OutboxMessage
from apps.outbox.receipts import receipt_taken_by_task, receipts_write_rows
from apps.outbox.sending import request_timeout
from apps.outbox.settlement import attempt_error_record, receipt_record
from apps.tasks.models import Task
from apps.tickets.connectors import Receipt, connector_for
from config.logs import bind

log = logging.getLogger(__name__)


@dataclass
class DirectSend:
    """A row claimed at its intent whose attempt is written: the row (its ``lease_generation`` the
    fencing token), its action and task, the parameters to send, the attempt row, the lease owner."""

    message: OutboxMessage
    action: Action
    task: Task
    params: dict
    attempt: ActionAttempt
    owner: str


def direct_attempt_open(*, message: OutboxMessage, action: Action, task: Task, owner: str) -> DirectSend | None:
    """Step 1's second half, in the intent's transaction (the caller's), for ``message`` just
    written claimed by ``owner``: re-authorize (:func:`~apps.outbox.dispatch.preflight` at now)
    and, when it says ``"send"``, write the attempt row (number 1, the row's fencing token) and
    count it on the row. Returns the :class:`DirectSend`, or None when the row must take the
    one-row path after the commit (:func:`~apps.outbox.dispatch.outbox_deliver`). Raises what the
    database raises."""
    check = preflight(message, action, task, now=timezone.now())
    if check.kind != "send":
        return None
    attempt = attempts_start([(action, message.lease_generation)], worker=owner, now=timezone.now())[action.pk]
    OutboxMessage.objects.filter(pk=message.pk).update(attempts=attempt.number)
    message.attempts = attempt.number
    return DirectSend(message=message, action=action, task=task, params=check.params, attempt=attempt, owner=owner)


def direct_send(send: DirectSend) -> Receipt | None:
    """Step 2, outside any transaction (the intent and the attempt row are committed): the request
    with the action's stable idempotency key and the row's fencing token, its timeout bounded by
    the task's deadline. An error answer is recorded as a dispatcher records it
    (:func:`~apps.outbox.settlement.attempt_error_record`: unknown, retry with backoff, failure),
    and a receipt that is not a new ticket is recorded the one-row way
    (:func:`~apps.outbox.settlement.receipt_record`); both return None. Returns a new ticket's
    receipt, for :func:`direct_receipt_record`."""
    action, message = send.action, send.message
    bind(tenant_id=action.tenant_id, task_id=action.task_id, action_id=action.pk, outbox_id=message.pk,
         fencing_token=message.lease_generation, attempt=send.attempt.number, step="dispatch:direct")
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


def direct_receipt_record(send: DirectSend, receipt: Receipt) -> bool:
    """Step 3's first half, in the caller's transaction (the run's, which appends the task's
    ``receipt.recorded`` next, read back from the action row by
    :func:`~apps.outbox.receipts.receipt_unsettled`): lock the action; unless it is SUCCEEDED
    already (a dispatcher that took the row over recorded it), write the receipt on the outbox's
    rows (:func:`~apps.outbox.receipts.receipts_write_rows`) when the task takes it now. Returns
    False when the task does not take it (cancelled meanwhile, another action current): the
    caller records it after its commit with :func:`~apps.outbox.settlement.receipt_record`, where
    δ's refusal is recorded; True otherwise."""
    action = sql.row(Action, "t0.id = %s", [send.action.pk], tail="FOR UPDATE")
    if action.status == ActionStatus.SUCCEEDED:
        return True
    if not receipt_taken_by_task(action):
        return False
    receipts_write_rows([(action, send.attempt.pk, receipt)], now=timezone.now())
    return True
