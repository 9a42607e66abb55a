"""The Celery application (DESIGN.md §2): queues ``agent``, ``tools`` and ``outbox``; beat ticks."""

import os

from celery import Celery
from celery.signals import beat_init, task_postrun, task_prerun, worker_init, worker_process_init

import config.env  # noqa: F401 - reads .env first: development opts in to the local settings there

# Production unless told otherwise (config/settings/production.py): a deployment fails closed.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

app = Celery("faultdesk")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_init.connect
@beat_init.connect
def _refuse_to_start_unless_deployable(**_):
    """A production worker or beat with a missing or development secret does not start."""
    from config.deploy_checks import refuse_to_start_unless_deployable

    refuse_to_start_unless_deployable()


@task_prerun.connect
def _log_context(task_id=None, task=None, **_):
    """Each Celery task starts with a clean log context naming the Celery task; the runtime binds
    the tenant, task, action and attempt ids once it has read them."""
    from config.logs import bind, clear

    clear()
    bind(celery_task=getattr(task, "name", None), celery_task_id=task_id)


@task_prerun.connect
@task_postrun.connect
def _database_connections(sender=None, **_):
    """Around each task, Django's rule for its connections, as around each request: closed when
    past ``CONN_MAX_AGE``, unusable (an error left it in a failed state), or failing the health
    check; otherwise kept for the next task (Celery's own fixup, which would close it every time,
    is held off by ``CELERY_DB_REUSE_MAX`` in settings)."""
    from django.db import close_old_connections

    if getattr(getattr(sender, "request", None), "is_eager", False):
        return  # run in the caller's process (Task.apply): its connection is the caller's, as for the fixup
    close_old_connections()


@worker_process_init.connect
def _tracing(**_):
    """Spans of Celery tasks and their outbound calls, per worker process (after the fork); a
    no-op without an OTLP endpoint."""
    from config.tracing import setup_tracing

    setup_tracing("worker")
