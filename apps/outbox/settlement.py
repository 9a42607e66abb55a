"""Settlement of an outbox row (DESIGN.md §6, §7; spec §16.4, table 16.5): the receipt (action
SUCCEEDED, ticket mirror, outbox DELIVERED and the task's ``receipt.recorded`` in one transaction),
"not executed" only when it is known — no attempt can have reached the remote, or the key was
first fenced at the remote with the row's current fencing token and nothing was found — the
outcome events a dispatcher or reconciler records on the task, and what an attempt's error answer
leads to (:func:`attempt_error_record`: unknown, a retry with backoff, a conflict, or a failure)."""

from __future__ import annotations

import logging
import random
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.actions.registry import tool_get
from apps.actions.services import attempts_close_with_receipt
from apps.approvals.services import approval_invalidate
from apps.core import tool_errors as errors
from apps.core.queue import AGENT_STEP, enqueue_on_commit
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.tasks import reducer
from apps.tasks.answer import completion_event
from apps.tasks.models import Task
from apps.tasks.store import refused_after_rollback, task_append_event, task_append_with_retry
from apps.tickets.connectors import Receipt, connector_for
from apps.tickets.models import TicketMirror

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
