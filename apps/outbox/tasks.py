"""Celery tasks of the outbox: the dispatcher (kicked on commit by
:func:`apps.outbox.services.outbox_enqueue`, ticked by beat), the tasks' half of its batched
receipts (sent by the dispatcher's commit) and the reconciler (beat). Thin: they call the outbox's
services. Addressed by name (:mod:`apps.core.queue`)."""

from __future__ import annotations

import logging

from celery import shared_task

from apps.core import queue

log = logging.getLogger(__name__)


@shared_task(name=queue.OUTBOX_DISPATCH)
def dispatch_pending() -> int:
    from apps.outbox.dispatch import outbox_drain

    queue.kick_received(queue.OUTBOX_DISPATCH)  # before the first claim: a later commit kicks again
    return outbox_drain()


@shared_task(name=queue.RECEIPTS_SETTLE)
def settle_receipts(*task_ids: str) -> int:
    """The tasks' half of a batch of receipts (:func:`apps.outbox.receipts.receipts_settle`), on
    the ``agent`` queue. A task it could not settle (it logs why) is re-queued by the lease sweeper,
    whose agent step settles it (:func:`apps.agent.runner.completion_on_receipt`)."""
    from apps.outbox.receipts import receipts_settle

    return receipts_settle(list(task_ids))


@shared_task(name=queue.OUTBOX_RECONCILE)
def reconcile_unknown() -> int:
    from apps.outbox.unknown_outcomes import actions_reconcile

    return actions_reconcile()
