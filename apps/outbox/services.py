"""The outbox's one write for other apps (DESIGN.md §1 step 6, §6): :func:`outbox_enqueue` queues an
action in the intent's own transaction. Claiming and delivering rows is :mod:`apps.outbox.dispatch`;
receipts, fences and "not executed" are :mod:`apps.outbox.settlement`; unknown outcomes are
reconciled by :mod:`apps.outbox.unknown_outcomes`."""

from __future__ import annotations

import logging

from django.utils import timezone

from apps.core import sql
from apps.core.queue import OUTBOX_DISPATCH, kick_on_commit
from apps.outbox.models import OutboxMessage

log = logging.getLogger(__name__)


def outbox_enqueue(*, action, ordering_key: str) -> OutboxMessage:
    """Queue ``action`` (an :class:`~apps.actions.models.Action` just created) for dispatch, due
    now, in the caller's transaction (the intent's: DESIGN.md §1 step 6), and kick the dispatcher
    once that transaction commits (coalesced: :func:`~apps.core.queue.kick_on_commit`; beat ticks
    it anyway). ``ordering_key``: rows with the same key are delivered one after the other
    (per-ticket order)."""
    message = sql.insert(OutboxMessage(tenant_id=action.tenant_id, action=action, ordering_key=ordering_key,
                                       available_at=timezone.now()))
    kick_on_commit(OUTBOX_DISPATCH)
    return message


