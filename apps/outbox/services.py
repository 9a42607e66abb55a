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
nothing was found (:func:`settle_not_executed`). After the fence, a stalled dispatcher holding
an older token is refused by the remote, so it can never create the ticket later.

Per-ticket ordering: a row is only claimed when no older row with the same ``ordering_key`` is
still undelivered. The reconciler of unknown outcomes is :mod:`apps.outbox.unknown_outcomes`.
"""

from __future__ import annotations

import logging

from django.utils import timezone

from apps.core.queue import OUTBOX_DISPATCH, enqueue_on_commit
from apps.outbox.models import OutboxMessage

log = logging.getLogger(__name__)


def outbox_enqueue(*, action, ordering_key: str) -> OutboxMessage:
    """Queue ``action`` (an :class:`~apps.actions.models.Action` just created) for dispatch, due
    now, in the caller's transaction (the intent's: DESIGN.md §1 step 6), and kick the dispatcher
    once that transaction commits (beat ticks it anyway). ``ordering_key``: rows with the same key
    are delivered one after the other (per-ticket order)."""
    message = OutboxMessage.objects.create(tenant_id=action.tenant_id, action=action, ordering_key=ordering_key,
                                           available_at=timezone.now())
    enqueue_on_commit(OUTBOX_DISPATCH)
    return message


