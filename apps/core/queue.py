"""The one way to start background work (DESIGN.md §2: Redis is a hint to run, PostgreSQL is the
truth). Celery tasks are addressed by name, so a caller never imports the module that defines the
task (and the runtime's modules never import each other to kick one another); Celery routes each
name to its queue by ``CELERY_TASK_ROUTES``."""

from __future__ import annotations

import logging

from celery import current_app
from django.db import transaction

log = logging.getLogger(__name__)

#: the agent's next steps for a task (queue ``agent``): ``(task_id,)``
AGENT_STEP = "agent_step"
#: retrieval, the device read and the open-ticket read for a task (queue ``tools``): ``(task_id,)``
READ_CONTEXT = "read_context"
#: the outbox dispatcher (queue ``outbox``): no arguments
OUTBOX_DISPATCH = "dispatch_pending"
#: the reconciler of unknown outcomes (queue ``outbox``, beat): no arguments
OUTBOX_RECONCILE = "reconcile_unknown"
#: the lease sweeper (queue ``agent``, beat): no arguments
SWEEP_LEASES = "sweep_leases"
#: wake the tasks whose pending approval expired (queue ``agent``, beat): no arguments
EXPIRE_APPROVALS = "expire_approvals"
#: recount the full-text term frequencies of tenants whose chunks changed (queue ``tools``, beat)
REFRESH_TERM_STATISTICS = "refresh_term_statistics"


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
