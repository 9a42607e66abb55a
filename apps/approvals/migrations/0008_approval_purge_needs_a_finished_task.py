"""The purge of an approval's copies needs its task finished, not only marked purged (ADR 0019's floor,
ADR 0020).

0007 admitted the purge of a decided approval's copies when its task's ``purged`` marker was at that
level. The marker stays when a purged task takes events again: a late receipt on a cancelled task
opens a compensation (``COMPENSATING``) under a new approval. Purging that approval once granted
made what a person approved unsendable (a purged approval is refused as authority) and the agent's
invalidation of it failed on this very trigger, step after step. Now the trigger also requires the
task to be terminal (``COMPLETED``, ``FAILED``, ``CANCELLED``) with no unreconciled action
(``INTENDED``, ``UNKNOWN``) — the floor the task purge keeps — read when the UPDATE runs.
"""

import importlib

from django.db import migrations

BEFORE = importlib.import_module("apps.approvals.migrations.0007_approval_copy_purge")
OLD_CHECK = """    SELECT t.purged INTO task_level FROM tasks_task t WHERE t.id = NEW.task_id;
    IF coalesce(faultdesk_purge_rank(task_level), 0) < faultdesk_purge_rank(NEW.purged) THEN
        RAISE EXCEPTION 'approval %: its task is not purged to %', OLD.id, NEW.purged
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
"""
NEW_CHECK = OLD_CHECK + """    IF NOT EXISTS (SELECT 1 FROM tasks_task t WHERE t.id = NEW.task_id
                                                 AND t.status IN ('COMPLETED', 'FAILED', 'CANCELLED'))
            OR EXISTS (SELECT 1 FROM actions_action a WHERE a.task_id = NEW.task_id
                                                        AND a.status IN ('INTENDED', 'UNKNOWN')) THEN
        RAISE EXCEPTION 'approval %: its task is not finished or has an unreconciled action', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
"""
_GUARD_AT = BEFORE.FUNCTIONS.index("CREATE OR REPLACE FUNCTION faultdesk_approval_copy_guard")
GUARD_BEFORE = BEFORE.FUNCTIONS[_GUARD_AT:]
assert OLD_CHECK in GUARD_BEFORE  # noqa: S101 — 0007's text is what this replaces
GUARD_AFTER = GUARD_BEFORE.replace(OLD_CHECK, NEW_CHECK)


class Migration(migrations.Migration):
    dependencies = [("approvals", "0007_approval_copy_purge"), ("actions", "0007_alter_action_options_alter_actionattempt_options")]

    operations = [migrations.RunSQL(GUARD_AFTER, GUARD_BEFORE)]
