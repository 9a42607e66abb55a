"""Batched delivery, steps 3 and 4 for the rows of a claimed batch that may be sent now (DESIGN.md
§6; docs/architecture.md, "Batched delivery"): their attempt rows committed in one transaction
before any request leaves, the requests sent concurrently on the process's sender threads — the new
tickets for a ticket system with a batch endpoint several to a request — and the outcomes recorded
(the receipts together, every error answer alone). Claiming, re-authorization and the one-row path
are :mod:`apps.outbox.dispatch`."""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt
from apps.actions.registry import tool_get
from apps.actions.services import attempts_start
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.outbox.models import OutboxMessage
from apps.outbox.receipts import receipts_record_batch
from apps.outbox.settlement import action_deadline, attempt_error_record
from apps.tasks.models import Task
from apps.tickets.connectors import connector_for
from config.logs import bind, unbind

log = logging.getLogger(__name__)


@dataclass
class _Send:
    """One row of a batch on its way out: the claimed row, its action and task, the attempt row
    written for it, the parameters to send, and what came back (a receipt or a ToolError)."""

    message: OutboxMessage
    action: Action
    task: Task
    params: dict
    attempt: ActionAttempt | None = None
    receipt: object = None
    error: errors.ToolError | None = None


_HOLD_SQL = """
SELECT o.id FROM {outbox} o JOIN unnest(%(ids)s::uuid[], %(tokens)s::int[]) AS h(id, token)
    ON o.id = h.id AND o.lease_generation = h.token
FOR UPDATE OF o
"""
_ATTEMPTS_SQL = """
UPDATE {outbox} o SET attempts = v.number FROM unnest(%(ids)s::uuid[], %(numbers)s::int[]) AS v(id, number)
WHERE o.id = v.id
"""


def _attempts_open(sends: list[_Send], owner: str) -> list[_Send]:
    """Step 3 for a batch: in one transaction, lock the rows still held at their fencing tokens,
    write one attempt row per such row and count it on the row. Returns the sends that may go
    out (a row another dispatcher re-claimed is dropped: the new holder owns it)."""
    if not sends:
        return []
    table = OutboxMessage._meta.db_table
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_HOLD_SQL.format(outbox=table), {
            "ids": [str(s.message.pk) for s in sends], "tokens": [s.message.lease_generation for s in sends]})
        held = {row[0] for row in cursor.fetchall()}
        kept = [send for send in sends if send.message.pk in held]
        if not kept:
            return []
        attempts = attempts_start([(send.action, send.message.lease_generation) for send in kept], worker=owner,
                                  now=timezone.now())
        for send in kept:
            send.attempt = attempts[send.action.pk]
            send.message.attempts = send.attempt.number
        cursor.execute(_ATTEMPTS_SQL.format(outbox=table), {
            "ids": [str(s.message.pk) for s in kept], "numbers": [s.attempt.number for s in kept]})
    return kept


def request_timeout(action: Action, task: Task) -> float:
    """The timeout of ``action``'s request (seconds): its tool's deadline, bounded by its task's
    (two seconds before it), and at least half a second."""
    remaining = (action_deadline(action, task) - timezone.now()).total_seconds() - 2.0
    return max(0.5, min(tool_get(action.tool).deadline_seconds, remaining))


def _send_one(send: _Send) -> None:
    """Step 4 for one row of a batch (run on a sender thread; touches no database): the request
    with the action's stable idempotency key, its timeout bounded by the task's deadline. Stores
    the receipt or the ToolError on ``send``."""
    action = send.action
    bind(tenant_id=action.tenant_id, task_id=action.task_id, action_id=action.pk, outbox_id=send.message.pk,
         fencing_token=send.message.lease_generation, attempt=send.attempt.number, step="dispatch")
    timeout = request_timeout(send.action, send.task)
    failpoint("before_send")
    try:
        send.receipt = connector_for(action.tool, action.connector).execute(
            tool=action.tool, idempotency_key=action.idempotency_key,
            fencing_token=send.message.lease_generation, params=send.params, timeout=timeout,
        )
    except errors.ToolError as exc:
        send.error = exc
        return
    failpoint("after_send")


def _send_many(sends: list[_Send]) -> None:
    """Step 4 for several new tickets of a batch on one ticket system in one request (run on a
    sender thread; touches no database): each item with its own action's idempotency key and
    its row's fencing token, the request's timeout the shortest of theirs. Stores each row's
    receipt or ToolError on its ``send`` (:meth:`~apps.tickets.connectors.ReferenceTicketConnector.create_tickets`)."""
    first = sends[0].action
    # the copied context may hold one row's ids (the last one the batch bound): none of them is this
    # request's alone
    unbind("tenant_id", "task_id", "action_id", "outbox_id", "fencing_token", "attempt")
    bind(step="dispatch", outbox_batch=len(sends),
         outbox_ids=[str(s.message.pk) for s in sends], action_ids=[str(s.action.pk) for s in sends])
    timeout = min(request_timeout(send.action, send.task) for send in sends)
    failpoint("before_send")
    outcomes = connector_for(first.tool, first.connector).create_tickets(
        [(s.action.idempotency_key, s.message.lease_generation, s.params) for s in sends], timeout=timeout)
    for send, outcome in zip(sends, outcomes, strict=True):
        if isinstance(outcome, errors.ToolError):
            send.error = outcome
        else:
            send.receipt = outcome
    failpoint("after_send")


def _requests(sends: list[_Send]) -> list[list[_Send]]:
    """The batch's rows grouped into requests: the new tickets for a ticket system with a batch
    endpoint in as few requests as its batch size allows (evenly filled, so they go out side by
    side), every other row alone."""
    sizes: dict[str, int] = {}  # ticket system -> its batch size (1: none)
    groups: dict[str, list[_Send]] = {}
    requests = []
    for send in sends:
        action = send.action
        if action.tool == "ticket.create":
            if action.connector not in sizes:
                sizes[action.connector] = getattr(connector_for(action.tool, action.connector), "batch_size", 1)
            if sizes[action.connector] > 1:
                groups.setdefault(action.connector, []).append(send)
                continue
        requests.append([send])
    for name, group in groups.items():
        count = -(-len(group) // sizes[name])
        requests += [group[i::count] for i in range(count)]
    return requests


def deliver_together(ready: list, tasks: dict, owner: str) -> None:
    """Attempt rows, concurrent sends and settlement of the rows of a batch that may be sent now
    (see :func:`~apps.outbox.dispatch.outbox_dispatch_batch`)."""
    sends = _attempts_open([_Send(message=m, action=m.action, task=tasks[m.action.task_id], params=c.params)
                            for m, c in ready], owner)
    if not sends:
        return
    width = max(1, min(len(sends), settings.FAULTDESK["OUTBOX_SEND_CONCURRENCY"]))
    # Each send runs in a copy of this context, so its log lines carry the Celery task's ids and
    # its own row's (bound in _send_one), on whichever thread it runs.
    context = contextvars.copy_context()

    def run(request: list[_Send]) -> None:
        context.copy().run(_guarded_send, request)

    requests = _requests(sends)
    if width == 1 or len(requests) == 1:
        for request in requests:
            run(request)
    else:
        list(_senders().map(run, requests))
    actor = f"dispatcher:{owner}"
    receipts_record_batch([(s.action.pk, s.attempt.pk, s.receipt) for s in sends if s.receipt is not None],
                          actor=actor)
    for send in sends:
        if send.error is None:
            continue
        bind(tenant_id=send.action.tenant_id, task_id=send.action.task_id, action_id=send.action.pk,
             outbox_id=send.message.pk, fencing_token=send.message.lease_generation, attempt=send.attempt.number,
             step="dispatch")
        try:
            attempt_error_record(send.message, send.action, send.attempt, send.task, send.error,
                          send.message.lease_generation, owner)
        except Exception:  # noqa: BLE001 - one bad row must not stop the batch; its lease expires
            log.exception("recording the outcome of outbox message %s failed", send.message.pk)


_SENDERS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_SENDERS_LOCK = threading.Lock()


def _senders() -> ThreadPoolExecutor:
    """The process's sender threads, ``FAULTDESK["OUTBOX_SEND_CONCURRENCY"]`` of them, started once
    (a child process after a fork starts its own) rather than for every batch; a smaller batch uses
    some of them. Threads start as work arrives, up to that number."""
    width = max(1, settings.FAULTDESK["OUTBOX_SEND_CONCURRENCY"])
    key = (os.getpid(), width)
    pool = _SENDERS.get(key)
    if pool is None:
        with _SENDERS_LOCK:
            pool = _SENDERS.get(key)
            if pool is None:
                pool = _SENDERS[key] = ThreadPoolExecutor(max_workers=width, thread_name_prefix="outbox-send")
    return pool


def _guarded_send(request: list[_Send]) -> None:
    """:func:`_send_one` (one row) or :func:`_send_many`, with an unexpected exception logged: the
    rows' attempts stay in flight and their leases expire (the next claim resends with the same
    keys), as on the one-row path."""
    try:
        if len(request) == 1:
            _send_one(request[0])
        else:
            _send_many(request)
    except Exception:  # noqa: BLE001
        log.exception("sending outbox messages %s failed", [str(s.message.pk) for s in request])
