"""The approval binding trigger (0003) fires only when an UPDATE names one of the bound columns and
changes it (:func:`apps.core.immutable.immutable_trigger_sql`). The refusal is the same; recording
a decision no longer runs PL/pgSQL for the row."""

from django.db import migrations

from apps.core.immutable import immutable_trigger_sql

IMMUTABLE = ("tenant_id", "task_id", "requested_by_id", "tool", "tool_version", "params", "action_digest",
             "object_type", "object_id", "object_version", "policy_version", "approver_roles", "scope",
             "side_effects", "evidence")
DROP = "DROP TRIGGER IF EXISTS approval_binding_immutable ON approvals_approvalrequest;"
BEFORE = (f"CREATE TRIGGER approval_binding_immutable BEFORE UPDATE ON approvals_approvalrequest FOR EACH ROW "
          f"EXECUTE FUNCTION faultdesk_refuse_immutable_update({', '.join(repr(c) for c in IMMUTABLE)});")


class Migration(migrations.Migration):
    dependencies = [("approvals", "0003_approval_binding_immutable"), ("actions", "0006_action_identity_trigger_fires_on_change")]

    operations = [
        migrations.RunSQL(DROP + immutable_trigger_sql("approval_binding_immutable", "approvals_approvalrequest",
                                                       IMMUTABLE),
                          DROP + BEFORE),
    ]
