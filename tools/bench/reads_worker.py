"""The Celery app of ``make bench``'s ``reads`` phase: ``config.celery``'s, with retrieval made slow on
demand, so that the phase can measure a slow retrieval as it measures a slow ticket system. Bench
only (``celery -A tools.bench.reads_worker worker …``).

In each worker process (after the fork), the ``evidence_select`` both ways of reading call —
``apps.agent.context`` (``reducer/5``, one read after the other) and ``apps.agent.reads``
(``reducer/6``) — first sleeps the seconds written in the file ``FAULTDESK_BENCH_SLOW_RETRIEVAL_FILE``
(a decimal number; no file, an empty one or ``0``: no sleep). The file is read at each retrieval, so
the bench changes the setting between reports without restarting the worker."""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery.signals import worker_process_init

from config.celery import app

#: the environment variable naming the file that holds the extra seconds of each retrieval
SLOW_RETRIEVAL_FILE = "FAULTDESK_BENCH_SLOW_RETRIEVAL_FILE"


def slow_retrieval_seconds(path: str | None) -> float:
    """The seconds written in the file ``path`` (0.0 without a path, a file or a number)."""
    if not path:
        return 0.0
    try:
        return max(float(Path(path).read_text().strip() or 0), 0.0)
    except (OSError, ValueError):
        return 0.0


@worker_process_init.connect
def _slow_retrieval(**_) -> None:
    from apps.agent import context, reads

    path = os.environ.get(SLOW_RETRIEVAL_FILE)
    for module in (context, reads):
        real = module.evidence_select

        def slowed(*args, _real=real, **kwargs):
            if (seconds := slow_retrieval_seconds(path)) > 0:
                time.sleep(seconds)
            return _real(*args, **kwargs)

        module.evidence_select = slowed


__all__ = ["app"]
