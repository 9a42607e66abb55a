"""Beat: the retention purge (:mod:`apps.retention.purge`), on the ``maintenance`` queue."""

from __future__ import annotations

from celery import shared_task

from apps.core import queue


@shared_task(name=queue.PURGE_EXPIRED)
def purge_expired() -> dict | None:
    """One purge run: ``{"complete", "tasks", "tables"}`` of its record, or None when another run
    held the lock."""
    from apps.retention.purge import purge_run

    run = purge_run()
    return None if run is None else {"complete": run.complete, "tasks": run.tasks, "tables": run.tables}
