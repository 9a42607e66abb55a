"""The outbox dispatcher (DESIGN.md §6, §7; spec §16.4, algorithm 16.1 steps
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
nothing was found (:func:`_settle_not_executed`). After the fence, a stalled dispatcher holding
an older token is refused by the remote, so it can never create the ticket later.

Per-ticket ordering: a row is only claimed when no older row with the same ``ordering_key`` is
still undelivered. The reconciler of unknown outcomes is :mod:`apps.outbox.unknown_outcomes`.
"""

from __future__ import annotations

import logging
import random
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, Max, OuterRef, Q
from django.utils import timezone

from apps.accounts.principal import principal_current
from apps.actions.digest import sendable
from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.actions.registry import tool_get
from apps.approvals.services import approval_check_binding_now, approval_invalidate
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.core.queue import AGENT_STEP, OUTBOX_DISPATCH, enqueue_on_commit
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.store import refused_after_rollback, task_append_with_retry, worker_identity
from apps.tickets.connectors import Receipt, connector_for
from apps.tickets.models import TicketMirror
from config.logs import bind

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 60.0


def outbox_enqueue(*, action, ordering_key: str) -> OutboxMessage:
    """Queue ``action`` (an :class:`~apps.actions.models.Action` just created) for dispatch, due
    now, in the caller's transaction (the intent's: DESIGN.md §1 step 6), and kick the dispatcher
    once that transaction commits (beat ticks it anyway). ``ordering_key``: rows with the same key
    are delivered one after the other (per-ticket order)."""
    message = OutboxMessage.objects.create(tenant_id=action.tenant_id, action=action, ordering_key=ordering_key,
                                           available_at=timezone.now())
    enqueue_on_commit(OUTBOX_DISPATCH)
    return message


def backoff_delay(attempt: int, *, rng: random.Random | None = None) -> float:
    """Exponential backoff with full jitter: uniform(0, min(cap, base · 2^attempt)) seconds, with
    the base from ``FAULTDESK["RETRY_BACKOFF_BASE_SECONDS"]`` (default 1 s)."""
    rng = rng or random.Random()  # noqa: S311 - jitter, not security
    base = settings.FAULTDESK.get("RETRY_BACKOFF_BASE_SECONDS", BACKOFF_BASE_SECONDS)
    return rng.uniform(0, min(BACKOFF_CAP_SECONDS, base * (2**attempt)))


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


def _still_ours(message_id, fencing_token: int):
    return OutboxMessage.objects.select_for_update().filter(pk=message_id, lease_generation=fencing_token)


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
        settled = _settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        _finish_not_sent(message, action, fencing_token, OutboxStatus.CANCELLED, "cancelled before send", actor)
        return "cancelled"
    # The person the ticket is filed for must still be a requester of the tenant, with an active
    # account (a compensation, which takes back what was done, goes on regardless).
    if action.compensates_id is None:
        requester = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
        if requester is None or not requester.is_requester:
            settled = _settle_not_executed(message, action, fencing_token, actor)
            if settled is not None:
                return settled
            _finish_not_sent(message, action, fencing_token, OutboxStatus.FAILED,
                             "the requester no longer holds a requester role (or the account is deactivated)", actor)
            return "failed"
    # h(a) recomputed from the exact parameters the connector is handed below (decoded from the
    # bytes hashed): a changed parameter is caught here even when its stored digest was left as it was.
    params, digest = sendable(tool=action.tool, tool_version=action.tool_version, params=action.params)
    if action.approval_id is None and digest != action.params_digest:
        reason = "the parameters to send differ from the committed ones (h(a) recomputed at send)"
        settled = _settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled
        _finish_not_sent(message, action, fencing_token, OutboxStatus.FAILED, reason, actor)
        return "failed"
    if action.approval_id is not None:
        check = approval_check_binding_now(approval=action.approval, action_digest=digest, now=now)
        if not check.ok:
            # An earlier attempt, sent while the approval still held, may have created the ticket.
            settled = _settle_not_executed(message, action, fencing_token, actor)
            if settled is not None:
                return settled
            with transaction.atomic():
                if not _still_ours(message.pk, fencing_token).exists():
                    return "lost_lease"
                approval_invalidate(approval=action.approval, reason=check.reason)
                Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT,
                                                           last_error={"reason": check.reason})
                OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.FAILED,
                                                                   last_error={"reason": check.reason},
                                                                   lease_owner=None, lease_expires_at=None)
                applied = _append_or_record_refusal(
                    task_id=task.pk, event_type="approval.invalidated", actor=actor,
                    payload_fn=lambda t: {"approval_id": str(action.approval_id), "reason": check.reason,
                                          "action_not_sent": True},
                )
                if not applied:
                    # Cancelled meanwhile: the task still learns the action was not sent, which
                    # releases its reservation.
                    _append_or_record_refusal(
                        task_id=task.pk, event_type="dispatch.failed", actor=actor,
                        payload_fn=lambda t: {"action_id": str(action.pk), "error": check.reason,
                                              "executed": False},
                    )
                _kick_agent(task.pk)
            return "invalidated"

    # A ticket system without idempotency: before any resend, look the key up (after every
    # unanswered request can no longer take effect) — found is the receipt, never a second ticket.
    if not connector_for(action.tool, action.connector).idempotent_by_key:
        settled = _settle_not_executed(message, action, fencing_token, actor)
        if settled is not None:
            return settled

    # 3. the attempt row is durable before the request leaves
    with transaction.atomic():
        if not _still_ours(message.pk, fencing_token).exists():
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


def _kick_agent(task_id) -> None:

    enqueue_on_commit(AGENT_STEP, task_id)


def _append_or_record_refusal(*, task_id, event_type: str, actor: str, payload_fn) -> bool:
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


def _may_have_executed(action_id, *, except_attempt_id=None) -> bool:
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


def _fence(action: Action, token: int):
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


def _settle_not_executed(message, action, fencing_token: int, actor: str, *, except_attempt_id=None) -> str | None:
    """Establish that the action was not executed before anyone records so (DESIGN.md §6).

    Returns None when "not executed" is proven: no attempt may have reached the remote, or the
    key, fenced at the remote with this dispatcher's ``fencing_token``, has no ticket — and no
    older token can create one any more. Otherwise returns the outcome already recorded here:
    ``"receipt"`` (the ticket exists: a late effect of an earlier attempt, recorded as the
    receipt), ``"undecided"`` (the remote could not be asked: the row goes back to PENDING with
    backoff and the next claim asks again) or ``"lost_lease"``."""
    if not _may_have_executed(action.pk, except_attempt_id=except_attempt_id):
        return None
    try:
        found = _fence(action, fencing_token)
    except errors.ToolError as exc:
        with transaction.atomic():
            if not _still_ours(message.pk, fencing_token).exists():
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


def _finish_not_sent(message, action, fencing_token, status, reason, actor="dispatcher") -> None:
    with transaction.atomic():
        if not _still_ours(message.pk, fencing_token).exists():
            return
        Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT, last_error={"reason": reason})
        OutboxMessage.objects.filter(pk=message.pk).update(status=status, last_error={"reason": reason},
                                                           lease_owner=None, lease_expires_at=None)
        _append_or_record_refusal(
            task_id=action.task_id, event_type="dispatch.failed", actor=actor,
            payload_fn=lambda t: {"action_id": str(action.pk), "error": reason, "executed": False},
        )


def _record_error(message, action, attempt, task, exc: errors.ToolError, fencing_token, owner) -> str:
    """Record the error ``exc`` of this dispatcher's attempt: ``"unknown"`` (sent, unanswered:
    the reconciler looks it up), ``"retry"`` (a retryable refusal: PENDING with backoff),
    ``"failed"`` (definite, and not executed — proven first by :func:`_settle_not_executed` when
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
        settled = _settle_not_executed(message, action, fencing_token, actor, except_attempt_id=attempt.pk)
        if settled is not None:
            # This attempt's own answer was definite; the action's outcome was settled above.
            ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.FAILED, error=err,
                                                               finished_at=now)
            return settled
    with transaction.atomic():
        # A dispatcher whose lease on the row passed to another (or whose action already has its
        # receipt) records nothing: the current holder owns the outcome.
        if not _still_ours(message.pk, fencing_token).exists():
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
            _append_or_record_refusal(task_id=task.pk, event_type="outcome.unknown", actor=actor,
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
            _append_or_record_refusal(task_id=task.pk, event_type="dispatch.conflict", actor=actor,
                                      payload_fn=lambda t: {"action_id": str(action.pk),
                                                            "expected_version": action.params.get("if_match"),
                                                            "current_version": exc.body.get("current_version"),
                                                            "executed": False})
            _kick_agent(task.pk)
            return "conflict"
        ActionAttempt.objects.filter(pk=attempt.pk).update(outcome=AttemptOutcome.FAILED, error=err, finished_at=now)
        Action.objects.filter(pk=action.pk).update(status=ActionStatus.FAILED, last_error=err)
        OutboxMessage.objects.filter(pk=message.pk).update(status=OutboxStatus.FAILED, last_error=err,
                                                           lease_owner=None, lease_expires_at=None)
        _append_or_record_refusal(task_id=task.pk, event_type="dispatch.failed", actor=actor,
                                  payload_fn=lambda t: {"action_id": str(action.pk), "error": err["code"],
                                                        "detail": err["detail"], "executed": False})
    return "failed"


def _is_conflict(action: Action, exc: errors.ToolError) -> bool:
    """A conditional write refused because the ticket is no longer at the version it was planned on
    (412), or no longer exists (404): either way nothing was written and the plan is stale."""
    if not (tool_get(action.tool).conditional and isinstance(exc, errors.PreconditionFailed)):
        return False
    return (exc.status, exc.body.get("error")) in ((412, "version_mismatch"), (404, "not_found"))


def receipt_record(*, action_id, receipt: Receipt, attempt_id=None, actor: str, resolution: dict | None = None) -> None:
    """Record a receipt (DESIGN.md §1 step 8): action SUCCEEDED, ticket mirror, outbox DELIVERED
    and the task's ``receipt.recorded`` event (settling the budget reservation) in one
    transaction; then the agent composes the answer. Idempotent: a second receipt for the same
    action changes nothing. ``resolution`` (a person's reconciliation: who, why, verified how) is
    recorded in the event payload."""
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
        if attempt_id is not None:
            ActionAttempt.objects.filter(pk=attempt_id).update(outcome=AttemptOutcome.RECEIPT, finished_at=now)
        # Attempts whose dispatcher never reported (died or stalls): one of them may be the one
        # that created the ticket, none is still "in flight" for the record.
        ActionAttempt.objects.filter(action_id=action_id, outcome=AttemptOutcome.IN_FLIGHT).exclude(
            pk=attempt_id).update(outcome=AttemptOutcome.UNKNOWN, finished_at=now,
                                  error={"detail": "no report from its dispatcher; the action has its receipt"})
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
        task_append_with_retry(
            task_id=action.task_id, event_type="receipt.recorded", actor=actor,
            payload_fn=lambda t: {"action_id": str(action.pk), "receipt": receipt.as_dict(),
                                  "cost": action.reservation, "recorded_at": now.isoformat(),
                                  **({"resolution": resolution} if resolution else {})},
        )
        _kick_agent(action.task_id)
