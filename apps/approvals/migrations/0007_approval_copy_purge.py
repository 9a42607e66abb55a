"""An approval's copies of the evidence excerpts and of the free text it approved may be emptied by
the retention purge — and that is the only change they admit (ADR 0020).

Before: the binding trigger (0003/0004) refused any change of ``params`` and ``evidence``, so a
person's report text and the excerpts lived forever in approvals. Now:

* ``approval_binding_immutable`` still refuses any change of the binding — tool, tool version, h(a)
  (``action_digest``), object, V_o, V_p, approver roles, scope, effects, requester, task, tenant —
  but no longer names ``params`` and ``evidence``;
* ``approval_copy_purge_only`` admits a change of ``params``, ``evidence``, ``purged`` or
  ``purged_at`` only when it is exactly the purge: the level goes up (``""`` → ``excerpts`` →
  ``payload``) with its time; the approval is decided (not ``PENDING``); its task is purged to that
  level or beyond; no decision column moves in the same UPDATE; and the new ``params`` and
  ``evidence`` are exactly :sql:`faultdesk_approval_purged_params` / ``…_evidence`` of the old ones
  (computed here, in the database: a partial or a different change is refused). Once purged, the
  decision columns of an approval never move again.

The purge itself (``apps.approvals.retention``) writes its UPDATE with the same two functions, so
what it writes and what the trigger admits are one definition.
"""

from django.db import migrations, models

from apps.core.immutable import immutable_trigger_sql

#: the binding, as in 0004, without the two copies the purge may empty
BINDING = ("tenant_id", "task_id", "requested_by_id", "tool", "tool_version", "action_digest",
           "object_type", "object_id", "object_version", "policy_version", "approver_roles", "scope",
           "side_effects")
BINDING_BEFORE = BINDING[:6] + ("params",) + BINDING[6:] + ("evidence",)
DROP_BINDING = "DROP TRIGGER IF EXISTS approval_binding_immutable ON approvals_approvalrequest;"

#: keys whose values are copies of document text (the evidence refs' excerpt, the answer's quotes)
EXCERPT_KEYS = ("excerpt", "quotes")
#: keys whose values are free text in a write's parameters: a ticket's title and description, a
#: comment's body, an update's comment and reason, an attachment's file name
FREE_TEXT_KEYS = ("title", "description", "body", "comment", "reason", "name")
#: what decides an approval; a purge moves none of it, and nothing moves it after a purge
DECISION = ("status", "decided_by_id", "decided_at", "reason", "expires_at", "respond_by")


def _row(prefix: str, cols) -> str:
    return "ROW(" + ", ".join(f'{prefix}."{c}"' for c in cols) + ")"


def _array(keys) -> str:
    return "ARRAY[" + ", ".join(f"'{k}'" for k in keys) + "]::text[]"


FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION faultdesk_jsonb_emptied(v jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE jsonb_typeof(v) WHEN 'string' THEN '""'::jsonb WHEN 'array' THEN '[]'::jsonb
                                WHEN 'object' THEN '{{}}'::jsonb ELSE v END
$$;

CREATE OR REPLACE FUNCTION faultdesk_jsonb_strip_keys(v jsonb, keys text[]) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF jsonb_typeof(v) = 'object' THEN
        RETURN coalesce((SELECT jsonb_object_agg(k, CASE WHEN k = ANY(keys) THEN faultdesk_jsonb_emptied(x)
                                                        ELSE faultdesk_jsonb_strip_keys(x, keys) END)
                         FROM jsonb_each(v) AS e(k, x)), '{{}}'::jsonb);
    ELSIF jsonb_typeof(v) = 'array' THEN
        RETURN coalesce((SELECT jsonb_agg(faultdesk_jsonb_strip_keys(x, keys) ORDER BY i)
                         FROM jsonb_array_elements(v) WITH ORDINALITY AS a(x, i)), '[]'::jsonb);
    END IF;
    RETURN v;
END;
$$;

CREATE OR REPLACE FUNCTION faultdesk_purge_rank(level text) RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE level WHEN '' THEN 0 WHEN 'excerpts' THEN 1 WHEN 'payload' THEN 2 END
$$;

CREATE OR REPLACE FUNCTION faultdesk_approval_purged_evidence(evidence jsonb, level text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF level NOT IN ('excerpts', 'payload') THEN
        RAISE EXCEPTION 'unknown purge level %', level USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN faultdesk_jsonb_strip_keys(evidence, {_array(EXCERPT_KEYS)});
END;
$$;

CREATE OR REPLACE FUNCTION faultdesk_approval_purged_params(params jsonb, level text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF level = 'excerpts' THEN
        RETURN faultdesk_jsonb_strip_keys(params, {_array(EXCERPT_KEYS)});
    ELSIF level = 'payload' THEN
        RETURN faultdesk_jsonb_strip_keys(params, {_array(EXCERPT_KEYS + FREE_TEXT_KEYS)});
    END IF;
    RAISE EXCEPTION 'unknown purge level %', level USING ERRCODE = 'invalid_parameter_value';
END;
$$;

CREATE OR REPLACE FUNCTION faultdesk_approval_copy_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    task_level text;
BEGIN
    IF OLD.purged <> '' AND {_row("OLD", DECISION)} IS DISTINCT FROM {_row("NEW", DECISION)} THEN
        RAISE EXCEPTION 'approval % was purged: its decision cannot change', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF ROW(OLD.params, OLD.evidence, OLD.purged, OLD.purged_at)
            IS NOT DISTINCT FROM ROW(NEW.params, NEW.evidence, NEW.purged, NEW.purged_at) THEN
        RETURN NEW;
    END IF;
    -- from here on the UPDATE changes a copy or the purge marker: it must be exactly the purge
    IF coalesce(faultdesk_purge_rank(NEW.purged), -1) <= coalesce(faultdesk_purge_rank(OLD.purged), 0)
            OR NEW.purged_at IS NULL THEN
        RAISE EXCEPTION 'column approvals_approvalrequest.params/evidence of a committed row cannot change '
                        '(only the retention purge to a deeper level empties their text)'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF OLD.status = 'PENDING' THEN
        RAISE EXCEPTION 'approval % is pending: it is not purged', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF {_row("OLD", DECISION)} IS DISTINCT FROM {_row("NEW", DECISION)} THEN
        RAISE EXCEPTION 'the purge of approval % changes its copies only, not its decision', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    SELECT t.purged INTO task_level FROM tasks_task t WHERE t.id = NEW.task_id;
    IF coalesce(faultdesk_purge_rank(task_level), 0) < faultdesk_purge_rank(NEW.purged) THEN
        RAISE EXCEPTION 'approval %: its task is not purged to %', OLD.id, NEW.purged
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF NEW.params IS DISTINCT FROM faultdesk_approval_purged_params(OLD.params, NEW.purged)
            OR NEW.evidence IS DISTINCT FROM faultdesk_approval_purged_evidence(OLD.evidence, NEW.purged) THEN
        RAISE EXCEPTION 'approval %: a purge to % empties exactly the text of its copies', OLD.id, NEW.purged
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$$;
"""

GUARD = ("CREATE TRIGGER approval_copy_purge_only BEFORE UPDATE ON approvals_approvalrequest FOR EACH ROW "
         "WHEN (OLD.purged <> '' OR ROW(OLD.params, OLD.evidence, OLD.purged, OLD.purged_at) "
         "IS DISTINCT FROM ROW(NEW.params, NEW.evidence, NEW.purged, NEW.purged_at)) "
         "EXECUTE FUNCTION faultdesk_approval_copy_guard();")
DROP_GUARD = "DROP TRIGGER IF EXISTS approval_copy_purge_only ON approvals_approvalrequest;"
DROP_FUNCTIONS = ("DROP FUNCTION IF EXISTS faultdesk_approval_copy_guard(); "
                  "DROP FUNCTION IF EXISTS faultdesk_approval_purged_params(jsonb, text); "
                  "DROP FUNCTION IF EXISTS faultdesk_approval_purged_evidence(jsonb, text); "
                  "DROP FUNCTION IF EXISTS faultdesk_purge_rank(text); "
                  "DROP FUNCTION IF EXISTS faultdesk_jsonb_strip_keys(jsonb, text[]); "
                  "DROP FUNCTION IF EXISTS faultdesk_jsonb_emptied(jsonb);")


class Migration(migrations.Migration):
    dependencies = [("approvals", "0006_alter_approvalpolicy_options_and_more"), ("tasks", "0008_task_purge_markers")]

    operations = [
        migrations.AddField(model_name="approvalrequest", name="purged",
                            field=models.CharField(blank=True, db_default="", default="", max_length=16)),
        migrations.AddField(model_name="approvalrequest", name="purged_at",
                            field=models.DateTimeField(blank=True, null=True)),
        migrations.RunSQL(FUNCTIONS, DROP_FUNCTIONS),
        migrations.RunSQL(
            DROP_BINDING + immutable_trigger_sql("approval_binding_immutable", "approvals_approvalrequest", BINDING)
            + GUARD,
            DROP_GUARD + DROP_BINDING + immutable_trigger_sql("approval_binding_immutable", "approvals_approvalrequest",
                                                             BINDING_BEFORE),
        ),
    ]
