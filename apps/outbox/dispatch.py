"""The outbox dispatcher: claim and deliver (DESIGN.md §6, §7; spec §16.4, algorithm 16.1 steps
4–6, table 16.5).

Dispatch of one row:

1. claim: ``SELECT … FOR UPDATE SKIP LOCKED`` a batch of due rows, lease them and bump each row's
   fencing token (``lease_generation``), which travels with the request;
2. re-authorize at the moment of dispatch (TOCTOU): task not cancelled, approval binding (h(a),
   V_o now, expiry, approver's current role);
3. write the attempt row *before* sending, so a crash mid-call leaves evidence of an attempt;
4. send with the action's stable idempotency key and record exactly one of: receipt, definite
   failure, retryable refusal (back to PENDING with backoff), or unknown (reconcile).

"Not executed" is a claim about the remote, so it is only recorded when it is known: either no
attempt of the action can have reached the remote (every earlier attempt ended with a definite
answer), or the key was first *fenced* at the remote with the row's current fencing token and
nothing was found (:func:`settle_not_executed`). After the fence, a stalled dispatcher holding
an older token is refused by the remote, so it can never create the ticket later.

Per-ticket ordering: a row is only claimed when no older row with the same ``ordering_key`` is
still undelivered. The reconciler of unknown outcomes is :mod:`apps.outbox.unknown_outcomes`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.accounts.principal import principal_current
from apps.actions.digest import sendable
from apps.actions.models import Action, ActionAttempt, ActionStatus
from apps.approvals.services import approval_check_binding_now, approval_invalidate
from apps.core import sql
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.sending import deliver_together, request_timeout
from apps.outbox.settlement import (
    append_or_record_refusal,
    attempt_error_record,
    finish_not_sent,
    kick_agent,
    receipt_record,
    settle_not_executed,
    still_ours,
)
from apps.tasks import reducer
from apps.tasks.cancel_gate import cancels_in_flight_wait
from apps.tasks.models import Task
from apps.tasks.store import worker_identity
from apps.tickets.connectors import connector_for
from config.logs import bind

log = logging.getLogger(__name__)


#: The claim in one statement: due rows not behind an undelivered older row of their ordering key,
#: oldest first, skipping rows other dispatchers hold, leased to ``owner`` with the next fencing token.
#: "Not behind an older open row" is written as "the first open row of its key" (a scalar subquery,
#: which PostgreSQL runs per candidate as a probe of the ordering-key index) rather than ``NOT EXISTS``
#: (which it may plan as an anti-join re-reading every open row per candidate: 155 ms a claim over a
#: 1,000-row backlog when the statistics said the open rows were few). "First" is by age, then id:
#: two open rows of one key created in the same microsecond are sent one after the other too.
_CLAIM_SQL = """
WITH due AS (
    SELECT o.id FROM {outbox} o
    WHERE ((o.status = %(pending)s AND o.available_at <= %(now)s)
           OR (o.status = %(in_flight)s AND o.lease_expires_at < %(now)s))
      AND o.id = (SELECT u.id FROM {outbox} u WHERE u.ordering_key = o.ordering_key AND u.status = ANY(%(open)s)
                  ORDER BY u.created_at, u.id LIMIT 1)
    ORDER BY o.created_at, o.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE {outbox} m SET status = %(in_flight)s, lease_owner = %(owner)s, lease_expires_at = %(until)s,
    lease_generation = m.lease_generation + 1
FROM due WHERE m.id = due.id
RETURNING m.id
"""


def outbox_claim_batch(*, owner: str, limit: int, now=None) -> list[OutboxMessage]:
    """Claim up to ``limit`` due rows (PENDING and available, or IN_FLIGHT with an expired lease),
    skipping rows locked by other dispatchers and rows behind an undelivered older row with the
    same ordering key. Each claimed row gets a new fencing token (its ``lease_generation``, one
    more than before). Returns the rows as claimed, oldest first, each with its action and the
    action's approval read with it."""
    now = now or timezone.now()
    lease = timedelta(seconds=settings.FAULTDESK["OUTBOX_LEASE_SECONDS"])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_CLAIM_SQL.format(outbox=OutboxMessage._meta.db_table), {
            "pending": OutboxStatus.PENDING.value, "in_flight": OutboxStatus.IN_FLIGHT.value, "now": now,
            "open": [OutboxStatus.PENDING.value, OutboxStatus.IN_FLIGHT.value, OutboxStatus.UNKNOWN.value],
            "limit": limit, "owner": owner, "until": now + lease})
        ids = [row[0] for row in cursor.fetchall()]
        if not ids:
            return []
        # Read while the claim's locks are held: each row's token is the one this claim gave it.
        return sql.rows(OutboxMessage, "t0.id = ANY(%s)", [ids], related=("action", "action__approval"),
                        tail="ORDER BY t0.created_at")


def outbox_drain(*, limit: int | None = None, max_seconds: float | None = None) -> int:
    """Claim and deliver batches (:func:`outbox_dispatch_batch`) one after another while each comes
    back full, for at most ``max_seconds`` (default ``FAULTDESK["OUTBOX_DRAIN_SECONDS"]``), so one
    kick of the dispatcher drains a backlog instead of one batch of it. Returns the rows processed.

    Every batch is claimed, re-authorized, fenced and settled exactly as a batch alone; the loop
    only saves a Celery hand-off per batch. It stops at the first batch that is not full (what is
    left is not due, behind an older row of its ordering key, or leased by another dispatcher) —
    unless a row of that batch has a due successor of its ordering key, which its delivery may have
    unblocked (no commit kicks for it) — and at the time cap, which is at most half a lease: rows
    claimed by a batch that failed are not claimed again by the same loop, so each round claims
    rows it has not held, or nothing and stops."""
    limit = limit or settings.FAULTDESK["OUTBOX_BATCH"]
    cap = settings.FAULTDESK["OUTBOX_DRAIN_SECONDS"] if max_seconds is None else max_seconds
    cap = min(cap, settings.FAULTDESK["OUTBOX_LEASE_SECONDS"] / 2)
    stop = time.monotonic() + cap
    total, seen = 0, set()
    while True:
        rows = _dispatch_batch(limit=limit)
        total += len(rows)
        seen.update(row.pk for row in rows)
        if time.monotonic() >= stop:
            return total
        if len(rows) < limit and not _successors_due({row.ordering_key for row in rows}, seen):
            return total


_SUCCESSORS_SQL = """
SELECT EXISTS (SELECT 1 FROM {outbox} WHERE ordering_key = ANY(%s) AND status = %s AND available_at <= %s
               AND NOT (id = ANY(%s::uuid[])))
"""


def _successors_due(keys: set[str], seen: set) -> bool:
    """Whether a due PENDING row this drain has not processed (``seen``) shares an ordering key
    with ``keys`` (rows just processed): it was behind one of them and may be claimable now, and
    no commit kicks the dispatcher for it."""
    if not keys:
        return False
    with connection.cursor() as cursor:
        cursor.execute(_SUCCESSORS_SQL.format(outbox=OutboxMessage._meta.db_table),
                       [list(keys), OutboxStatus.PENDING.value, timezone.now(), [str(pk) for pk in seen]])
        return cursor.fetchone()[0]


#: whether each task of a batch has a cancel request in its state (the one key of the state the batch
#: reads), in the select list: only the batch's rows are read from the JSON, whatever the plan
_CANCEL_REQUESTED_SQL = """
SELECT id, coalesce((state ->> 'cancel_requested')::boolean, false) FROM {task} WHERE id = ANY(%s)
"""


def outbox_dispatch_batch(*, limit: int | None = None) -> int:
    """One batch (see :func:`_dispatch_batch`). Returns how many rows were processed."""
    return len(_dispatch_batch(limit=limit))


def _dispatch_batch(*, limit: int | None = None) -> list[OutboxMessage]:
    """Claim and deliver one batch (DESIGN.md §6; docs/architecture.md, "Batched delivery").
    Returns the rows claimed.

    The rows that pass re-authorization at once (:func:`preflight` says ``"send"``) go together:
    their attempt rows are committed in one transaction before any request leaves, the new
    tickets for a ticket system with a batch endpoint go in as few requests as its batch size
    allows (each item with its own idempotency key and fencing token), the requests are sent
    concurrently (at most ``FAULTDESK["OUTBOX_SEND_CONCURRENCY"]`` at a time; a claim never holds
    two rows of one ordering key, so per-ticket order holds), and the receipts are recorded
    together (:func:`~apps.outbox.receipts.receipts_record_batch`). Every other row —
    not authorized any more, a ticket system without idempotency, an error answer — takes the
    one-row path (:func:`outbox_deliver`, :func:`~apps.outbox.settlement.attempt_error_record`)."""
    owner = worker_identity()
    rows = outbox_claim_batch(owner=owner, limit=limit or settings.FAULTDESK["OUTBOX_BATCH"])
    if not rows:
        return []
    # Each row holds the fencing token this claim gave it (read under the claim's locks). The tasks'
    # states (15-20 KB of JSON each) are not read: re-authorization needs only whether a cancel was
    # requested, read as that one key.
    task_ids = list({m.action.task_id for m in rows})
    # every cancel of these tasks already begun ends before their status is read (a lock timeout
    # raises here: nothing is sent, and the rows are claimed again once their leases expire)
    cancels_in_flight_wait(*task_ids)
    tasks = {t.pk: t for t in sql.rows(Task, "t0.id = ANY(%s)", [task_ids], related=("tenant",),
                                       defer=frozenset({"state"}))}
    with connection.cursor() as cursor:
        cursor.execute(_CANCEL_REQUESTED_SQL.format(task=Task._meta.db_table), [task_ids])
        cancel_requested = {task_id for task_id, requested in cursor.fetchall() if requested}
    principals: dict[tuple, object] = {}

    def requester_of(user_id, tenant_id):
        key = (user_id, tenant_id)
        if key not in principals:
            principals[key] = principal_current(user_id=user_id, tenant_id=tenant_id)
        return principals[key]

    now = timezone.now()
    ready, one_by_one = [], []
    for message in rows:
        # A row whose lease passed on since the claim (it went past its lease while this batch
        # waited) is fenced out below, when its attempt row is written.
        try:
            task = tasks[message.action.task_id]
            check = preflight(message, message.action, task, now=now, requester_of=requester_of,
                              cancel_requested=task.pk in cancel_requested)
        except Exception:  # noqa: BLE001 - one bad row must not stop the batch; its lease expires
            log.exception("re-authorizing outbox message %s failed", message.pk)
            continue
        (ready if check.kind == "send" else one_by_one).append((message, check))
    for message, _ in one_by_one:
        try:
            outbox_deliver(message_id=message.pk, fencing_token=message.lease_generation, owner=owner)
        except Exception:  # noqa: BLE001 - one bad row must not stop the batch; its lease expires
            log.exception("delivering outbox message %s failed", message.pk)
    if ready:
        deliver_together(ready, tasks, owner)
    return rows


@dataclass(frozen=True)
class Preflight:
    """What the re-authorization at the moment of dispatch found for one claimed row (spec §16.4
    TOCTOU; DESIGN.md §7). ``kind`` is ``"send"`` (send ``params`` now), ``"lookup_first"`` (send
    ``params``, but the ticket system has no idempotency: look the key up first), or why it must
    not be sent: ``"cancelled"``, ``"requester"``, ``"digest"`` or ``"approval"`` (``reason``
    says what failed)."""

    kind: str
    params: dict | None = None
    reason: str = ""


def preflight(message: OutboxMessage, action: Action, task: Task, *, now, requester_of=None,
              cancel_requested: bool | None = None) -> Preflight:
    """Re-authorize ``action`` (of claimed row ``message``, task ``task``) at ``now``: the task not
    cancelled (a compensation runs on a cancelled task: it is what the cancel asked for, under its
    own approval), the person the ticket is filed for still an active requester of the tenant,
    h(a) recomputed from the exact parameters the connector is handed (decoded from the bytes
    hashed, so a changed parameter is caught even when its stored digest was left as it was), and
    the approval's binding (h(a), V_o now, expiry, approver's current role).

    ``requester_of(user_id, tenant_id)`` returns the current principal (default
    :func:`~apps.accounts.principal.principal_current`; a batch passes a per-batch cache).
    ``cancel_requested``: whether the task's state records a cancel request, when the caller read
    it without the state (default: read from ``task.state``). Reads only; writes nothing. Returns a
    :class:`Preflight`."""
    requester_of = requester_of or (lambda user_id, tenant_id: principal_current(user_id=user_id,
                                                                                 tenant_id=tenant_id))
    if cancel_requested is None:
        cancel_requested = bool(task.state.get("cancel_requested"))
    cancelled = task.status == reducer.CANCELLED or cancel_requested
    if cancelled and action.compensates_id is None:
        return Preflight("cancelled", reason="cancelled before send")
    if action.compensates_id is None:
        requester = requester_of(task.requester_id, task.tenant_id)
        if requester is None or not requester.is_requester:
            return Preflight("requester", reason="the requester no longer holds a requester role "
                                                 "(or the account is deactivated)")
    params, digest = sendable(tool=action.tool, tool_version=action.tool_version, params=action.params)
    if action.approval_id is None and digest != action.params_digest:
        return Preflight("digest", reason="the parameters to send differ from the committed ones "
                                          "(h(a) recomputed at send)")
    if action.approval_id is not None:
        check = approval_check_binding_now(approval=action.approval, action_digest=digest, now=now)
        if not check.ok:
            return Preflight("approval", reason=check.reason)
    if not connector_for(action.tool, action.connector).idempotent_by_key:
        return Preflight("lookup_first", params=params)
    return Preflight("send", params=params)


def outbox_deliver(*, message_id, fencing_token: int, owner: str) -> str:
    """Deliver one claimed outbox row. Returns the outcome: ``"receipt"``, ``"failed"``,
    ``"conflict"`` (412 on a conditional write: the task re-plans), ``"retry"``, ``"unknown"``,
    ``"cancelled"``, ``"invalidated"`` or ``"lost_lease"``."""
    message = OutboxMessage.objects.select_related("action", "action__approval").get(pk=message_id)
    action = message.action
    cancels_in_flight_wait(action.task_id)  # a cancel already begun is seen (apps/tasks/cancel_gate.py)
    task = Task.objects.select_related("tenant").get(pk=action.task_id)
    now = timezone.now()
    bind(tenant_id=action.tenant_id, task_id=action.task_id, action_id=action.pk, outbox_id=message.pk,
         fencing_token=fencing_token, step="dispatch")

    # 2. re-authorize at the moment of dispatch
    actor = f"dispatcher:{owner}"
    check = preflight(message, action, task, now=now)
    if check.kind == "cancelled":
        settled = settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        finish_not_sent(message, action, fencing_token, OutboxStatus.CANCELLED, "cancelled before send", actor)
        return "cancelled"
    if check.kind in ("requester", "digest"):
        settled = settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        finish_not_sent(message, action, fencing_token, OutboxStatus.FAILED, check.reason, actor)
        return "failed"
    if check.kind == "approval":
        # An earlier attempt, sent while the approval still held, may have created the ticket.
        settled = settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        with transaction.atomic():
            if not still_ours(message.pk, fencing_token).exists():
                return "lost_lease"
            approval_invalidate(approval=action.approval, reason=check.reason)
            Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT,
                                                       last_error={"reason": check.reason})
            OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.FAILED,
                                                               last_error={"reason": check.reason},
                                                               lease_owner=None, lease_expires_at=None)
            applied = append_or_record_refusal(
                task_id=task.pk, event_type="approval.invalidated", actor=actor,
                payload_fn=lambda t: {"approval_id": str(action.approval_id), "reason": check.reason,
                                      "action_not_sent": True},
            )
            if not applied:
                # Cancelled meanwhile: the task still learns the action was not sent, which
                # releases its reservation.
                append_or_record_refusal(
                    task_id=task.pk, event_type="dispatch.failed", actor=actor,
                    payload_fn=lambda t: {"action_id": str(action.pk), "error": check.reason,
                                          "executed": False},
                )
            kick_agent(task.pk)
        return "invalidated"
    params = check.params
    if check.kind == "lookup_first":
        # A ticket system without idempotency: before any resend, look the key up (after every
        # unanswered request can no longer take effect) — found is the receipt, never a second ticket.
        settled = settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled

    # 3. the attempt row is durable before the request leaves
    with transaction.atomic():
        if not still_ours(message.pk, fencing_token).exists():
            return "lost_lease"
        number = action.attempts.count() + 1
        attempt = ActionAttempt.objects.create(
            action=action, number=number, fencing_token=fencing_token, started_at=timezone.now(), worker=owner,
        )
        OutboxMessage.objects.filter(pk=message.pk).update(attempts=number)
    bind(attempt=number)

    # 4. send with the stable idempotency key; the timeout is bounded by the task's deadline
    timeout = request_timeout(action, task)
    failpoint("before_send")
    try:
        receipt = connector_for(action.tool, action.connector).execute(
            tool=action.tool, idempotency_key=action.idempotency_key, fencing_token=fencing_token,
            params=params, timeout=timeout,
        )
    except errors.ToolError as exc:
        return attempt_error_record(message, action, attempt, task, exc, fencing_token, owner)
    failpoint("after_send")
    receipt_record(action_id=action.pk, receipt=receipt, attempt_id=attempt.pk, actor=f"dispatcher:{owner}")
    return "receipt"
