"""The approvals app's projection of task events (:func:`apps.tasks.store.projection_register`):
a task that is cancelled or ends leaves nothing to decide, so its pending approvals are
invalidated in the event's own transaction, with the reason (the queue shows them as such, and a
late decision gets 409; DESIGN.md §7)."""

from __future__ import annotations

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.tasks import reducer


def pending_approvals_close(task, event, new_state: dict) -> None:
    """Invalidate ``task``'s pending approvals on ``cancel.requested`` ("the task was cancelled")
    and when the event ends the task ("the task ended (STATUS: reason)"). ``task`` is the task as
    read before ``event``; runs inside the event's transaction."""
    cancelled = event.type == "cancel.requested"
    ended = new_state["status"] in reducer.TERMINAL and task.status not in reducer.TERMINAL
    if not (cancelled or ended):
        return  # most events: nothing to close, and no query built for it
    if not any((task.state or {}).get(k) or new_state.get(k) for k in ("approval", "compensation")):
        # No approval was ever asked for this task: its rows are created only with the events that
        # set ``approval`` or ``compensation`` in its state, which no later event sets back to None.
        return
    pending = ApprovalRequest.objects.for_tenant(task.tenant_id).filter(task_id=task.pk,
                                                                         status=ApprovalStatus.PENDING)
    if cancelled:
        cancelled_reason = "the task was cancelled"
        pending.update(status=ApprovalStatus.INVALIDATED, reason=cancelled_reason, closed_reason=cancelled_reason)
    if ended:
        reason = f"the task ended ({new_state['status']}: {new_state.get('termination_reason') or ''})"
        pending.update(status=ApprovalStatus.INVALIDATED, reason=reason[:2000], closed_reason=reason[:2000])
