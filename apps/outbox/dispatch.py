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
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from apps.accounts.principal import principal_current
from apps.actions.digest import sendable
from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.actions.registry import tool_get
from apps.approvals.services import approval_check_binding_now, approval_invalidate
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.settlement import (
    append_or_record_refusal,
    backoff_delay,
    finish_not_sent,
    kick_agent,
    receipt_record,
    settle_not_executed,
    still_ours,
)
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.store import worker_identity
from apps.tickets.connectors import connector_for
from config.logs import bind

log = logging.getLogger(__name__)


MAX_ATTEMPTS = 8
def outbox_claim_batch(*, owner: str, limit: int, now=None) -> list[OutboxMessage]:
    """Claim up to ``limit`` due rows (PENDING and available, or IN_FLIGHT with an expired lease),
    skipping rows locked by other dispatchers and rows behind an undelivered older row with the
    same ordering key. Each claimed row gets a new fencing token."""
    now = now or timezone.now()
    lease = timedelta(seconds=settings.FAULTDESK["OUTBOX_LEASE_SECONDS"])
    older_open = OutboxMessage.objects.filter(
        ordering_key=OuterRef("ordering_key"),
        created_at__lt=OuterRef("created_at"),
        status__in=[OutboxStatus.PENDING, OutboxStatus.IN_FLIGHT, OutboxStatus.UNKNOWN],
    )
    due = Q(status=OutboxStatus.PENDING, available_at__lte=now) | Q(
        status=OutboxStatus.IN_FLIGHT, lease_expires_at__lt=now
    )
    with transaction.atomic():
        rows = list(
            OutboxMessage.objects.select_for_update(skip_locked=True)
            .filter(due)
            .filter(~Exists(older_open))
            .order_by("created_at")[:limit]
        )
        for row in rows:
            row.status = OutboxStatus.IN_FLIGHT
            row.lease_owner = owner
            row.lease_expires_at = now + lease
            row.lease_generation += 1
            row.save(update_fields=["status", "lease_owner", "lease_expires_at", "lease_generation"])
    return rows


def outbox_dispatch_batch(*, limit: int | None = None) -> int:
    """Claim and deliver one batch. Returns how many rows were processed."""
    owner = worker_identity()
    rows = outbox_claim_batch(owner=owner, limit=limit or settings.FAULTDESK["OUTBOX_BATCH"])
    for row in rows:
        try:
            outbox_deliver(message_id=row.pk, fencing_token=row.lease_generation, owner=owner)
        except Exception:  # noqa: BLE001 - one bad row must not stop the batch; its lease expires
            log.exception("delivering outbox message %s failed", row.pk)
    return len(rows)


def outbox_deliver(*, message_id, fencing_token: int, owner: str) -> str:
    """Deliver one claimed outbox row. Returns the outcome: ``"receipt"``, ``"failed"``,
    ``"conflict"`` (412 on a conditional write: the task re-plans), ``"retry"``, ``"unknown"``,
    ``"cancelled"``, ``"invalidated"`` or ``"lost_lease"``."""
    message = OutboxMessage.objects.select_related("action", "action__approval").get(pk=message_id)
    action = message.action
    task = Task.objects.select_related("tenant").get(pk=action.task_id)
    now = timezone.now()
    bind(tenant_id=action.tenant_id, task_id=action.task_id, action_id=action.pk, outbox_id=message.pk,
         fencing_token=fencing_token, step="dispatch")

    # 2. re-authorize at the moment of dispatch (a compensation runs on a cancelled task: it is
    #    what the cancel asked for, under its own approval)
    actor = f"dispatcher:{owner}"
    cancelled = task.status == reducer.CANCELLED or task.state.get("cancel_requested")
    if cancelled and action.compensates_id is None:
        settled = settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        finish_not_sent(message, action, fencing_token, OutboxStatus.CANCELLED, "cancelled before send", actor)
        return "cancelled"
    # The person the ticket is filed for must still be a requester of the tenant, with an active
    # account (a compensation, which takes back what was done, goes on regardless).
    if action.compensates_id is None:
        requester = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
        if requester is None or not requester.is_requester:
            settled = settle_not_executed(message, action, fencing_token, actor)
            if settled is not None:
                return settled
            finish_not_sent(message, action, fencing_token, OutboxStatus.FAILED,
                             "the requester no longer holds a requester role (or the account is deactivated)", actor)
            return "failed"
    # h(a) recomputed from the exact parameters the connector is handed below (decoded from the
    # bytes hashed): a changed parameter is caught here even when its stored digest was left as it was.
    params, digest = sendable(tool=action.tool, tool_version=action.tool_version, params=action.params)
    if action.approval_id is None and digest != action.params_digest:
        reason = "the parameters to send differ from the committed ones (h(a) recomputed at send)"
        settled = settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        finish_not_sent(message, action, fencing_token, OutboxStatus.FAILED, reason, actor)
        return "failed"
    if action.approval_id is not None:
        check = approval_check_binding_now(approval=action.approval, action_digest=digest, now=now)
        if not check.ok:
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

    # A ticket system without idempotency: before any resend, look the key up (after every
    # unanswered request can no longer take effect) — found is the receipt, never a second ticket.
    if not connector_for(action.tool, action.connector).idempotent_by_key:
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
    contract = tool_get(action.tool)
    remaining = (action_deadline(action, task) - timezone.now()).total_seconds() - 2.0
    timeout = max(0.5, min(contract.deadline_seconds, remaining))
    failpoint("before_send")
    try:
        receipt = connector_for(action.tool, action.connector).execute(
            tool=action.tool, idempotency_key=action.idempotency_key, fencing_token=fencing_token,
            params=params, timeout=timeout,
        )
    except errors.ToolError as exc:
        return _record_error(message, action, attempt, task, exc, fencing_token, owner)
    failpoint("after_send")
    receipt_record(action_id=action.pk, receipt=receipt, attempt_id=attempt.pk, actor=f"dispatcher:{owner}")
    return "receipt"


def action_deadline(action: Action, task: Task):
    """When sending (and re-sending) ``action`` must stop: the task's deadline, or for a
    compensation — which runs after its task was cancelled — its own window of
    ``TASK_DEADLINE_SECONDS`` from its intent."""
    if action.compensates_id is None:
        return task.deadline_at
    return action.created_at + timedelta(seconds=settings.FAULTDESK["TASK_DEADLINE_SECONDS"])


def _record_error(message, action, attempt, task, exc: errors.ToolError, fencing_token, owner) -> str:
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
        if _is_conflict(action, exc):
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


def _is_conflict(action: Action, exc: errors.ToolError) -> bool:
    """A conditional write refused because the ticket is no longer at the version it was planned on
    (412), or no longer exists (404): either way nothing was written and the plan is stale."""
    if not (tool_get(action.tool).conditional and isinstance(exc, errors.PreconditionFailed)):
        return False
    return (exc.status, exc.body.get("error")) in ((412, "version_mismatch"), (404, "not_found"))
