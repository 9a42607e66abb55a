"""An approval is created whole: an INSERT that says it was already purged is refused (ADR 0020).

The purge's marks (``purged``, ``purged_at``) are only ever set by the one UPDATE the copy guard
admits, whose new values are computed from the old ones. An approval inserted with them set would
never have been checked against what it claims to be the purge of, and the binding audit would report
a copy that never matched h(a) as ``purged`` rather than as differing.
"""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION faultdesk_approval_born_unpurged() RETURNS trigger AS $$
BEGIN
    IF NEW.purged <> '' OR NEW.purged_at IS NOT NULL THEN
        RAISE EXCEPTION 'approval %: an approval is created unpurged (the purge is an UPDATE the copy guard checks)',
            NEW.id USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER approval_born_unpurged BEFORE INSERT ON approvals_approvalrequest
    FOR EACH ROW EXECUTE FUNCTION faultdesk_approval_born_unpurged();
"""
REVERSE = """
DROP TRIGGER IF EXISTS approval_born_unpurged ON approvals_approvalrequest;
DROP FUNCTION IF EXISTS faultdesk_approval_born_unpurged();
"""


class Migration(migrations.Migration):
    dependencies = [("approvals", "0008_approval_purge_needs_a_finished_task")]

    operations = [migrations.RunSQL(FUNCTION, REVERSE)]
