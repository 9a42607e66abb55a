"""The reconciler of unknown outcomes (DESIGN.md §6; spec table 16.5 "超时后不知道是否成功"): an
action whose send got no answer is looked up by its idempotency key at its ticket system — found
is the receipt, not found (once that is provable) is re-queued with the same key — and
:func:`action_settle_unknown` settles one for a person on the reconciliation page. The send itself
and the receipts are in :mod:`apps.outbox.settlement`."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, ActionStatus, AttemptOutcome
from apps.core import tool_errors as errors
from apps.core.queue import OUTBOX_DISPATCH, kick_on_commit
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.settlement import (
    MAX_ATTEMPTS,
    action_deadline,
    append_or_record_refusal,
    backoff_delay,
    fence,
    receipt_record,
)
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, refused_after_rollback, task_append_with_retry
from apps.tickets.connectors import Receipt, connector_for
from config.logs import bind

log = logging.getLogger(__name__)


def actions_reconcile(*, limit: int = 50) -> int:
    """The reconciler (DESIGN.md §6): for each action whose outcome is unknown, look it up by its
    idempotency key. Found → adopt the ticket as the receipt. Not found and the connector is
    idempotent by key → re-queue the same outbox row (same key, never a new logical action).
    Lookup failing → leave it for the next tick. Returns the number of actions examined."""
    unknown = list(Action.objects.filter(status=ActionStatus.UNKNOWN).order_by("updated_at")[:limit])
    for action in unknown:
        # Examined now: a failing action moves to the back of the queue instead of blocking it.
        now = timezone.now()
        Action.objects.filter(pk=action.pk).update(updated_at=now, last_reconciled_at=now,
                                                   reconcile_attempts=F("reconcile_attempts") + 1)
        try:
            _reconcile_one(action)
        except Exception:  # noqa: BLE001 - logged; the next tick tries again
            log.exception("reconciling action %s failed", action.pk)
    return len(unknown)


def _reconcile_one(action: Action) -> None:
    """Look one unknown action up by key: adopt the ticket found. Otherwise re-queue the same row
    (same key) with backoff — unless the task was cancelled, its deadline passed or the row used up
    its attempts: then the action is settled without sending again (:func:`action_settle_unknown`),
    which ends the wait with an explicit decision."""
    bind(tenant_id=action.tenant_id, task_id=action.task_id, action_id=action.pk, step="reconcile")
    try:
        found = connector_for(action.tool, action.connector).lookup(
            tool=action.tool, idempotency_key=action.idempotency_key, params=action.params)
    except errors.ToolError as exc:
        log.info("reconcile %s: lookup failed (%s)", action.pk, exc)
        Action.objects.filter(pk=action.pk).update(last_reconcile_error=exc.as_dict())
        return
    if found is not None:
        receipt_record(action_id=action.pk, receipt=found, actor="reconciler")
        return
    task = Task.objects.get(pk=action.task_id)
    message = OutboxMessage.objects.get(action=action)
    now = timezone.now()
    stop = None
    if action.compensates_id is None and (task.status == reducer.CANCELLED or task.state.get("cancel_requested")):
        stop = "cancelled"
    elif action_deadline(action, task) <= now:
        stop = "deadline passed"
    elif message.attempts >= MAX_ATTEMPTS:
        stop = f"{message.attempts} attempts used"
    if stop is not None:
        try:
            action_settle_unknown(action, actor="reconciler", reason=f"not sent again: {stop}")
        except (errors.ToolError, ActionChanged) as exc:
            log.info("reconcile %s: not settled yet (%s)", action.pk, exc)
        return
    _requeue_same_key(action, message, delay=backoff_delay(message.attempts))


def _requeue_same_key(action: Action, message: OutboxMessage, *, delay: float) -> None:
    """Send the same action (same key, same row) again after ``delay`` seconds, with a
    ``reconciliation.retry`` event in the same transaction. If δ refuses the event (the task was
    cancelled meanwhile) nothing changes and the refusal is recorded."""
    refused = None
    try:
        with transaction.atomic():
            claimed = Action.objects.select_for_update(skip_locked=True).filter(
                pk=action.pk, status=ActionStatus.UNKNOWN
            ).first()
            if claimed is None:
                return
            Action.objects.filter(pk=action.pk).update(status=ActionStatus.INTENDED)
            OutboxMessage.objects.filter(pk=message.pk).update(
                status=OutboxStatus.PENDING, available_at=timezone.now() + timedelta(seconds=delay),
                lease_owner=None, lease_expires_at=None,
            )
            task_append_with_retry(
                task_id=action.task_id, event_type="reconciliation.retry", actor="reconciler",
                payload_fn=lambda t, a=action: {"action_id": str(a.pk), "reason": "not found by key",
                                                "retry_in_seconds": round(delay, 3)},
            )
    except (reducer.IllegalTransition, StaleWrite) as exc:
        refused = exc
    if refused is not None:
        # Rolled back with the rows; keep the record of what was refused. The next tick settles it.
        reason = refused.reason if isinstance(refused, reducer.IllegalTransition) else str(refused)
        refused_after_rollback(task_id=action.task_id, event_type="reconciliation.retry",
                               payload={"action_id": str(action.pk), "reason": "not found by key"}, reason=reason,
                               actor="reconciler")
        return
    kick_on_commit(OUTBOX_DISPATCH)


class ActionChanged(Exception):
    """The action or its outbox row changed while it was being settled: another process acted.
    ``status`` is the action's status as it was then read."""

    def __init__(self, message: str, *, status: str):
        super().__init__(message)
        self.status = status


def action_settle_unknown(action: Action, *, actor: str, reason: str, resolution: dict | None = None) -> Receipt | None:
    """Settle an ``UNKNOWN`` action without sending it again (DESIGN.md §6, ADR 0009).

    Claims the action's outbox row with a new fencing token, fences the key at the ticket system
    with it and looks it up. Found: the ticket is recorded as the receipt and returned. Not
    found — and no request with an older token can create it any more: the action becomes
    ``NOT_SENT``, its row ``FAILED``, earlier attempts still marked in flight are closed as
    ``FAILED`` (fenced), and ``dispatch.failed`` (``executed: false``, ``reason``, ``resolution``)
    is appended; returns None.

    Raises a :class:`~apps.actions.errors.ToolError` when the ticket system cannot be asked
    (nothing is recorded) and :class:`ActionChanged` when the action is no longer unknown or its
    row was claimed by someone else meanwhile."""
    with transaction.atomic():
        locked = Action.objects.select_for_update().get(pk=action.pk)
        if locked.status != ActionStatus.UNKNOWN:
            raise ActionChanged(f"the action is {locked.status}", status=locked.status)
        OutboxMessage.objects.filter(action=action).update(lease_generation=F("lease_generation") + 1,
                                                            lease_owner=None, lease_expires_at=None)
        token = OutboxMessage.objects.get(action=action).lease_generation
    found = fence(action, token)
    if found is not None:
        # Whatever was asserted, the ticket system decides: it was executed.
        if resolution:
            resolution = {**resolution, "executed": True, "asserted_executed": resolution.get("executed"),
                          "verified": "found by key at the ticket system"}
        receipt_record(action_id=action.pk, receipt=found, actor=actor, resolution=resolution)
        return found
    now = timezone.now()
    with transaction.atomic():
        locked = Action.objects.select_for_update().get(pk=action.pk)
        if locked.status != ActionStatus.UNKNOWN or not OutboxMessage.objects.filter(
            action=action, lease_generation=token
        ).exists():
            raise ActionChanged(f"the action changed while it was being settled (now {locked.status})",
                                status=locked.status)
        Action.objects.filter(pk=action.pk).update(status=ActionStatus.NOT_SENT, last_error={"reason": reason})
        OutboxMessage.objects.filter(action=action).update(status=OutboxStatus.FAILED, last_error={"reason": reason})
        ActionAttempt.objects.filter(action=action, outcome=AttemptOutcome.IN_FLIGHT).update(
            outcome=AttemptOutcome.FAILED, finished_at=now,
            error={"detail": f"fenced at token {token}: this attempt can no longer take effect"},
        )
        payload = {"action_id": str(action.pk), "error": reason, "executed": False,
                   "fenced_at_token": token, **({"resolution": resolution} if resolution else {})}
        append_or_record_refusal(task_id=action.task_id, event_type="dispatch.failed", actor=actor,
                                  payload_fn=lambda t: payload)
    return None
