"""System check: idempotency keys are kept long enough (DESIGN.md §6).

An action's key must outlive every moment at which the same logical action could be sent again or
looked up: the task's whole deadline (retries), the reconciliation window (an unknown outcome
waiting for the reconciler or a person), and the database-restore window — after restoring a
backup that is ``RESTORE_WINDOW_DAYS`` old, an action recorded there as "intended" will be sent
again with its key, and only a key still held by faultdesk and the ticket system turns that into
a replay instead of a second ticket. ``manage.py check`` (and every ``runserver``/``migrate``)
fails with ``faultdesk.E001`` when ``IDEMPOTENCY_KEY_RETENTION_DAYS`` is shorter.

faultdesk never deletes an action row; the reference service and the helpdesk custom field keep
keys for as long as their tickets exist. The setting is the floor a purge job must respect.
"""

from __future__ import annotations

from django.conf import settings
from django.core.checks import Error, register


def key_retention_needed_days(conf: dict) -> float:
    """Days a key must be kept: deadline + reconciliation window + restore window."""
    return conf["TASK_DEADLINE_SECONDS"] / 86400 + conf["RECONCILE_WINDOW_DAYS"] + conf["RESTORE_WINDOW_DAYS"]


@register()
def key_retention_check(app_configs, **kwargs):
    """``faultdesk.E001`` when the configured key retention is shorter than needed."""
    conf = settings.FAULTDESK
    needed = key_retention_needed_days(conf)
    if conf["IDEMPOTENCY_KEY_RETENTION_DAYS"] < needed:
        return [Error(
            f"FAULTDESK_IDEMPOTENCY_KEY_RETENTION_DAYS={conf['IDEMPOTENCY_KEY_RETENTION_DAYS']} is shorter than the "
            f"{needed:.1f} days a key can still be used (task deadline + reconciliation window "
            f"{conf['RECONCILE_WINDOW_DAYS']} d + restore window {conf['RESTORE_WINDOW_DAYS']} d)",
            hint="raise the retention or shorten a window; a key dropped too early lets a retry after a restore "
                 "create a second ticket",
            id="faultdesk.E001",
        )]
    return []
