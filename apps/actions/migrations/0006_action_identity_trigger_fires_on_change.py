"""The action identity trigger (0005) fires only when an UPDATE names one of the immutable columns
and changes it (:func:`apps.core.immutable.immutable_trigger_sql`). The refusal is the same; an
UPDATE of outcome columns alone (a receipt, an error) no longer runs PL/pgSQL for every row."""

from django.db import migrations

from apps.core.immutable import immutable_trigger_sql

IMMUTABLE = ("tenant_id", "task_id", "tool", "tool_version", "connector", "params", "params_digest",
             "idempotency_key", "approval_id", "compensates_id", "object_version", "reservation")
DROP = "DROP TRIGGER IF EXISTS action_identity_immutable ON actions_action;"
BEFORE = (f"CREATE TRIGGER action_identity_immutable BEFORE UPDATE ON actions_action FOR EACH ROW "
          f"EXECUTE FUNCTION faultdesk_refuse_immutable_update({', '.join(repr(c) for c in IMMUTABLE)});")


class Migration(migrations.Migration):
    dependencies = [("actions", "0005_action_identity_immutable")]

    operations = [
        migrations.RunSQL(DROP + immutable_trigger_sql("action_identity_immutable", "actions_action", IMMUTABLE),
                          DROP + BEFORE),
    ]
