"""A committed action's identity cannot change: PostgreSQL refuses an UPDATE of its tool, tool
version, connector, parameters, digest, idempotency key, approval, object version, reservation,
task, tenant or the action it compensates (DESIGN.md §6-7: what was approved is what is sent).
Only its outcome columns (status, receipt, errors, reconciliation bookkeeping) move."""

from django.db import migrations

#: Shared by every table whose committed rows have immutable columns (apps.approvals too).
FUNCTION = """
CREATE OR REPLACE FUNCTION faultdesk_refuse_immutable_update() RETURNS trigger AS $$
DECLARE
    col text;
BEGIN
    FOREACH col IN ARRAY TG_ARGV LOOP
        IF (to_jsonb(OLD) -> col) IS DISTINCT FROM (to_jsonb(NEW) -> col) THEN
            RAISE EXCEPTION 'column %.% of a committed row cannot change', TG_TABLE_NAME, col
                USING ERRCODE = 'integrity_constraint_violation';
        END IF;
    END LOOP;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""

IMMUTABLE = ("tenant_id", "task_id", "tool", "tool_version", "connector", "params", "params_digest",
             "idempotency_key", "approval_id", "compensates_id", "object_version", "reservation")

TRIGGER = (f"CREATE TRIGGER action_identity_immutable BEFORE UPDATE ON actions_action FOR EACH ROW "
           f"EXECUTE FUNCTION faultdesk_refuse_immutable_update({', '.join(repr(c) for c in IMMUTABLE)});")


class Migration(migrations.Migration):
    dependencies = [("actions", "0004_action_compensates")]

    operations = [
        migrations.RunSQL(FUNCTION, migrations.RunSQL.noop),
        migrations.RunSQL(TRIGGER, "DROP TRIGGER IF EXISTS action_identity_immutable ON actions_action;"),
    ]
