"""The one way to start background work (DESIGN.md §2: Redis is a hint to run, PostgreSQL is the
truth). Celery tasks are addressed by name, so a caller never imports the module that defines the
task (and the runtime's modules never import each other to kick one another); Celery routes each
name to its queue by ``CELERY_TASK_ROUTES``."""

from __future__ import annotations

import logging

from celery import current_app
from django.conf import settings
from django.core.cache import caches
from django.db import transaction

log = logging.getLogger(__name__)

#: the agent's next steps for a task (queue ``agent``): ``(task_id,)``
AGENT_STEP = "agent_step"
#: retrieval, the device read and the open-ticket read for a task (queue ``tools``): ``(task_id,)``
READ_CONTEXT = "read_context"
#: one context read of a task, an activity of its own under a plan version (queue ``tools``,
#: ``reducer/6``): ``(task_id, activity_id)``
READ_STEP = "read_step"
#: the outbox dispatcher (queue ``outbox``): no arguments
OUTBOX_DISPATCH = "dispatch_pending"
#: the tasks' half of a batch of receipts the dispatcher recorded (queue ``agent``): ``(task_id, …)``
RECEIPTS_SETTLE = "settle_receipts"
#: the reconciler of unknown outcomes (queue ``outbox``, beat): no arguments
OUTBOX_RECONCILE = "reconcile_unknown"
#: the lease sweeper (queue ``agent``, beat): no arguments
SWEEP_LEASES = "sweep_leases"
#: wake the tasks whose pending approval expired (queue ``agent``, beat): no arguments
EXPIRE_APPROVALS = "expire_approvals"
#: record the service-level breaches due now as ``sla.breached`` events (queue ``agent``, beat)
MARK_SLA_BREACHES = "mark_sla_breaches"
#: send the attachments due to their tickets (queue ``outbox``, kicked on commit and by beat)
DELIVER_ATTACHMENTS = "deliver_attachments"
#: recount the full-text term frequencies of tenants whose chunks changed (queue ``tools``, beat)
REFRESH_TERM_STATISTICS = "refresh_term_statistics"
#: build the approvers' due digests and send the due notifications (queue ``outbox``; kicked on
#: commit, and beat's tick, which also takes back rows whose sender's lease expired): no arguments
NOTIFY_SEND = "send_notifications"
#: the retention purge (queue ``maintenance``, beat): no arguments
PURGE_EXPIRED = "purge_expired"


def send_now(name: str, *args) -> None:
    """Send the Celery task ``name`` with ``args`` now (routed by name). Raises what the broker
    raises; use :func:`enqueue_on_commit` for work that follows a database write."""
    current_app.send_task(name, args=[str(a) for a in args])


def enqueue_on_commit(name: str, *args) -> None:
    """Send the Celery task ``name`` with ``args`` after the current transaction commits (at once
    outside one), so no message is ever sent for a row that is not committed. A broker that is
    down is logged and not raised: the lease sweeper and the beat ticks bring the work back."""

    def go() -> None:
        try:
            send_now(name, *args)
        except Exception:  # noqa: BLE001 - broker down: the sweeper re-queues the work
            log.exception("could not enqueue %s%s", name, tuple(str(a) for a in args))

    transaction.on_commit(go)


def _waiting_key(name: str) -> str:
    return f"faultdesk:kick-waiting:{name}"


def _flag_taken(key: str, ttl: float) -> bool:
    """Set the hint ``key`` for ``ttl`` seconds if it is absent (``cache.add``: Redis ``SET NX``)
    and say whether this caller set it. True without a TTL or when the cache fails: a hint that
    is unavailable never holds a message back."""
    if ttl <= 0:
        return True
    try:
        return caches["coordination"].add(key, 1, timeout=ttl)
    except Exception:  # noqa: BLE001 - the hint is unavailable: send, as without it
        log.warning("the coordination cache failed; sending without the hint %s", key, exc_info=True)
        return True


def kick_on_commit(name: str) -> None:
    """After the current transaction commits, make sure a run of the argument-less Celery task
    ``name`` — one whose every run does all the work due when it starts (the outbox dispatcher) —
    starts after this commit: at most one such message waits at a time.

    After the commit, a flag is set only if absent (``cache.add``: Redis ``SET NX`` with the TTL
    ``FAULTDESK["KICK_COALESCE_SECONDS"]``, in the ``coordination`` cache); whoever sets it sends
    the message, anyone else relies on the one already waiting. The run clears the flag before it
    reads anything (:func:`kick_received`), so a commit that finds the flag set was made before that
    run's first read and is seen by it. The flag is a hint, never the truth: with coalescing off
    (TTL 0) or the cache failing the message is always sent, and a message the broker loses leaves
    the flag set at most one TTL, while beat's tick runs the task anyway."""
    ttl = settings.FAULTDESK.get("KICK_COALESCE_SECONDS", 0)

    def go() -> None:
        if not _flag_taken(_waiting_key(name), ttl):
            return  # a message is waiting and its run has not started: it sees this commit
        try:
            send_now(name)
        except Exception:  # noqa: BLE001 - broker down: beat's tick brings the work back
            log.exception("could not enqueue %s", name)
            if ttl > 0:
                kick_received(name)  # nothing waits after all: the next commit must send

    transaction.on_commit(go)


def kick_received(name: str) -> None:
    """Called by a run of ``name`` before its first read (see :func:`kick_on_commit`): from now
    on a commit sends a new message. Never raises."""
    try:
        caches["coordination"].delete(_waiting_key(name))
    except Exception:  # noqa: BLE001 - the flag expires on its own
        log.warning("the coordination cache failed clearing the kick of %s", name, exc_info=True)


def send_at_most_every(name: str, task_id, *, seconds: float) -> bool:
    """Send the Celery task ``name`` for ``task_id`` now, unless it was sent through here for the
    same task within the last ``seconds`` (a flag with that TTL in the ``coordination`` cache) —
    the lease sweeper's re-queue: a task waiting behind a backlog looks idle on every tick, and one
    message per tick for it only lengthens the backlog. Returns whether it was sent. With the cache
    failing, or no shared cache (non-Redis broker: the dummy cache), it always sends. Raises what
    the broker raises."""
    if not _flag_taken(f"faultdesk:requeued:{name}:{task_id}", seconds):
        return False
    send_now(name, task_id)
    return True
