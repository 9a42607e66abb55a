"""Structured logs: every log line — faultdesk's own, Django's, Celery's — goes through structlog's
``ProcessorFormatter``. With ``LOG_FORMAT=json`` (the default) it is one JSON object per line; with
``LOG_FORMAT=console`` a readable line for a terminal.

Context travels in ``contextvars``: the web middleware binds the request id, tenant and user; the
agent, the tools step and the dispatcher bind ``tenant_id``, ``task_id``, ``action_id`` and
``attempt``; the event log adds ``event_seq`` and ``event_type`` to its own line. Every line
carries whatever is bound at that moment, so a task's lines can be followed across processes.
"""

from __future__ import annotations

import contextlib
import logging

import structlog

SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def logging_config(*, fmt: str = "json", level: str = "INFO") -> dict:
    """The ``LOGGING`` dict for Django: one console handler whose formatter renders every record
    with structlog (``fmt`` ``json`` or ``console``)."""
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "structured": {
                "()": structlog.stdlib.ProcessorFormatter,
                "processors": [structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                               structlog.processors.format_exc_info, renderer],
                "foreign_pre_chain": SHARED,
            },
        },
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "structured"}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {"django.db.backends": {"level": "WARNING"}},
    }


def configure_structlog() -> None:
    """Route structlog's own loggers through the standard library (so they share the handler)."""
    structlog.configure(
        processors=[*SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def bind(**ids) -> None:
    """Bind ids (``tenant_id``, ``task_id``, ``action_id``, ``attempt`` …) to every following log
    line of this thread or task; ``None`` values are skipped."""
    structlog.contextvars.bind_contextvars(**{k: str(v) for k, v in ids.items() if v is not None})


@contextlib.contextmanager
def bound(**ids):
    """``with bound(tenant_id=…, task_id=…):`` — the ids bound (as :func:`bind`) for the block, the
    earlier values (or none) restored after it. The tool gateway records each call with the tenant and
    task bound here."""
    before = structlog.contextvars.get_contextvars()
    bind(**ids)
    try:
        yield
    finally:
        names = [k for k, v in ids.items() if v is not None]
        structlog.contextvars.unbind_contextvars(*names)
        structlog.contextvars.bind_contextvars(**{k: before[k] for k in names if k in before})


def unbind(*names: str) -> None:
    """Forget the bound ids ``names`` (one row's ids before a line about several rows)."""
    structlog.contextvars.unbind_contextvars(*names)


def clear() -> None:
    """Forget every bound id (at the start of a request or a Celery task)."""
    structlog.contextvars.clear_contextvars()


logging.captureWarnings(True)
