"""The outbox's one write for other apps (DESIGN.md §1 step 6, §6): :func:`outbox_enqueue` queues an
action in the intent's own transaction. Claiming and delivering rows is :mod:`apps.outbox.dispatch`;
receipts, fences and "not executed" are :mod:`apps.outbox.settlement`; unknown outcomes are
reconciled by :mod:`apps.outbox.unknown_outcomes`."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from apps.core import sql
from apps.core.queue import OUTBOX_DISPATCH, kick_on_commit
from apps.outbox.models import OutboxMessage, OutboxStatus

log = logging.getLogger(__name__)


def outbox_enqueue(*, action, ordering_key: str, deliver_by: str | None = None) -> OutboxMessage:
    """Queue ``action`` (an :class:`~apps.actions.models.Action` just created) for dispatch, due
    now, in the caller's transaction (the intent's: DESIGN.md §1 step 6), and kick the dispatcher
    once that transaction commits (coalesced: :func:`~apps.core.queue.kick_on_commit`; beat ticks
    it anyway). ``ordering_key``: rows with the same key are delivered one after the other
    (per-ticket order).

    ``deliver_by`` (a lease owner, ``host:pid``): direct delivery (docs/architecture.md §6). The row is
    written already claimed by that process — ``IN_FLIGHT``, leased for
    ``FAULTDESK["OUTBOX_LEASE_SECONDS"]``, fencing token 1, its first attempt counted, as a dispatcher's
    claim and attempt would leave it — and no dispatcher is kicked: the caller delivers it after the
    commit with :func:`~apps.outbox.dispatch.outbox_deliver` at that token. If the caller dies first,
    the lease expires and a dispatcher claims the row (with the next token), as it would a dead
    dispatcher's. Only for an ordering key no other row can hold (the action's own): a claim here does
    not look for an older open row of the key, which a concurrent intent could still be writing. Returns
    the row (its ``status`` says whether it was claimed)."""
    now = timezone.now()
    message = OutboxMessage(tenant_id=action.tenant_id, action=action, ordering_key=ordering_key, available_at=now)
    if deliver_by is not None:
        message.status = OutboxStatus.IN_FLIGHT
        message.lease_owner = deliver_by
        message.lease_expires_at = now + timedelta(seconds=settings.FAULTDESK["OUTBOX_LEASE_SECONDS"])
        message.lease_generation = 1
        message.attempts = 1  # the claimer's first attempt, whose row it writes in this transaction
    sql.insert(message)
    if deliver_by is None:
        kick_on_commit(OUTBOX_DISPATCH)
    return message
