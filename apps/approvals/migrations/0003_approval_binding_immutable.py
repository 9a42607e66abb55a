"""What an approval binds cannot change once asked: PostgreSQL refuses an UPDATE of its tool,
tool version, shown parameters and effects, h(a), object, V_o, V_p, scope, evidence, requester,
task or tenant. Only its decision columns (status, decided_by, decided_at, reason, expires_at) move."""

from django.db import migrations

IMMUTABLE = ("tenant_id", "task_id", "requested_by_id", "tool", "tool_version", "params", "action_digest",
             "object_type", "object_id", "object_version", "policy_version", "approver_roles", "scope",
             "side_effects", "evidence")

TRIGGER = (f"CREATE TRIGGER approval_binding_immutable BEFORE UPDATE ON approvals_approvalrequest FOR EACH ROW "
           f"EXECUTE FUNCTION faultdesk_refuse_immutable_update({', '.join(repr(c) for c in IMMUTABLE)});")


class Migration(migrations.Migration):
    dependencies = [("approvals", "0002_approver_roles"), ("actions", "0005_action_identity_immutable")]

    operations = [
        migrations.RunSQL(TRIGGER, "DROP TRIGGER IF EXISTS approval_binding_immutable ON approvals_approvalrequest;"),
    ]
