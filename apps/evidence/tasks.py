"""Celery tasks of the evidence app: the beat job that recounts term frequencies
(:mod:`apps.evidence.termstats`). Thin: it calls the service. Addressed by name
(:mod:`apps.core.queue`)."""

from __future__ import annotations

from celery import shared_task

from apps.core import queue


@shared_task(name=queue.REFRESH_TERM_STATISTICS)
def refresh_term_statistics() -> int:
    from apps.evidence.termstats import term_statistics_refresh_changed

    return term_statistics_refresh_changed()
