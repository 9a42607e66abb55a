"""The web of ``make bench``'s ``reads`` phase for tasks pinned to an older reducer: ``config.wsgi``
with ``apps.tasks.reducer.CURRENT`` set to ``FAULTDESK_BENCH_REDUCER`` (say ``reducer/5``), so that
the tasks it accepts carry that version in their artifact bundle — as tasks accepted before
``reducer/6`` became current do — and the workers run them as that version does. Bench only: the
product's web pins the current version (``gunicorn tools.bench.pinned_wsgi:application``)."""

import os

from config.wsgi import application


def _pin() -> None:
    from apps.tasks import reducer  # after Django is set up

    pinned = os.environ.get("FAULTDESK_BENCH_REDUCER", reducer.CURRENT)
    if pinned not in reducer.REDUCERS:
        raise SystemExit(f"FAULTDESK_BENCH_REDUCER={pinned!r}: this build carries {', '.join(reducer.REDUCERS)}")
    reducer.CURRENT = pinned


_pin()
__all__ = ["application"]
