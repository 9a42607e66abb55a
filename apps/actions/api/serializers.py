"""DRF shapes of actions and attempts, shared by the task API (a task's actions) and the
reconciliation API (actions whose outcome is unknown)."""

from __future__ import annotations

from rest_framework import serializers

from apps.actions.models import Action, ActionAttempt


class AttemptSerializer(serializers.ModelSerializer):
    """One try at sending an action: its number, the fencing token it carried, its outcome."""

    class Meta:
        model = ActionAttempt
        fields = ["number", "fencing_token", "outcome", "error", "started_at", "finished_at", "worker"]


class ActionSerializer(serializers.ModelSerializer):
    """An action as its task's admins see it (``GET /api/tasks/<id>/actions/``): the identity the
    ticket system was sent — tool and version, ticket system, parameter digest h(a), the
    idempotency key, the object version V_o it was authorized against — its status, receipt and
    attempts. The parameters themselves stay behind the access-checked payload view of the
    ``intent.committed`` event (spec §16.2 "动作"; DESIGN.md §6)."""

    approval_id = serializers.UUIDField(allow_null=True, read_only=True)
    compensates_id = serializers.UUIDField(allow_null=True, read_only=True)
    attempts = AttemptSerializer(many=True, read_only=True)

    class Meta:
        model = Action
        fields = ["id", "tool", "tool_version", "connector", "status", "idempotency_key", "params_digest",
                  "object_version", "approval_id", "compensates_id", "external_id", "external_version", "receipt",
                  "last_error", "reconcile_attempts", "attempts", "created_at", "updated_at"]
