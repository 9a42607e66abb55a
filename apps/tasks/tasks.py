"""Beat: record the service-level breaches due now (:mod:`apps.tasks.sla_breaches`)."""

from __future__ import annotations

from celery import shared_task

from apps.core import queue


@shared_task(name=queue.MARK_SLA_BREACHES)
def mark_sla_breaches() -> dict[str, int]:
    """``{"respond": n, "resolve": m}``: the ``sla.breached`` events appended by this run."""
    from apps.tasks.sla_breaches import sla_breaches_mark

    return sla_breaches_mark()
