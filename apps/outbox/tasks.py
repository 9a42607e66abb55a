"""Celery tasks of the outbox: the dispatcher (kicked on commit, ticked by beat) and the
reconciler (beat). Thin: they call :mod:`apps.outbox.services`."""

from __future__ import annotations

import logging

from celery import shared_task

log = logging.getLogger(__name__)


def enqueue_dispatch() -> None:
    """Kick the dispatcher now (call from ``transaction.on_commit``); beat ticks it anyway."""
    try:
        dispatch_pending.delay()
    except Exception:  # noqa: BLE001 - the beat tick delivers it later
        log.exception("could not kick the outbox dispatcher")


@shared_task(name="apps.outbox.tasks.dispatch_pending")
def dispatch_pending() -> int:
    from apps.outbox.services import outbox_dispatch_batch

    return outbox_dispatch_batch()


@shared_task(name="apps.outbox.tasks.reconcile_unknown")
def reconcile_unknown() -> int:
    from apps.outbox.unknown_outcomes import actions_reconcile

    return actions_reconcile()
