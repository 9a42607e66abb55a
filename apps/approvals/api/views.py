"""Approval API (DESIGN.md §7): the queue and decisions. Concurrent decisions: one wins, the
others get 409 with the current decision."""

from __future__ import annotations

from django.utils.translation import gettext as _
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.api import HasPrincipal, request_principal
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.selectors import IF_APPROVED, MOVED_STATUSES, approval_get, approval_list, evidence_moved
from apps.approvals.services import approval_decide
from apps.core.errors import Forbidden, NotFound


class ApprovalSerializer(serializers.ModelSerializer):
    task_id = serializers.UUIDField(source="task.id")
    device = serializers.CharField(source="task.device.asset_tag")
    requested_by = serializers.CharField(source="requested_by.username")
    decided_by = serializers.CharField(source="decided_by.username", allow_null=True, default=None)
    evidence_moved = serializers.SerializerMethodField(
        help_text="For a pending approval the task's own action waits on: {chunk_id: superseded | retired | "
                  "unreadable} for each cited chunk that moved since the approval was asked (unreadable: deleted, "
                  "or outside the requester's scopes now); empty when none did.")
    if_approved = serializers.SerializerMethodField(
        help_text="When evidence_moved is not empty, what approving does: asks_again (the action cannot be sent "
                  "as it is; the agent re-drafts and asks again), revalidates (the agent re-drafts first and "
                  "sends the action only if it comes out the same), sent_as_asked (a task without plan versions: "
                  "the action is sent as it was asked); null otherwise.")

    class Meta:
        model = ApprovalRequest
        fields = [
            "id", "task_id", "device", "tool", "tool_version", "params", "action_digest", "object_type", "object_id",
            "object_version", "policy_version", "approver_roles", "scope", "side_effects", "evidence", "expires_at",
            "status",
            "requested_by", "decided_by", "decided_at", "reason", "closed_reason", "created_at", "evidence_moved",
            "if_approved",
        ]

    def _moved(self, approval: ApprovalRequest):
        return self.context.get("evidence_moved", {}).get(approval.pk)

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "string", "enum": MOVED_STATUSES}})
    def get_evidence_moved(self, approval: ApprovalRequest) -> dict[str, str]:
        moved = self._moved(approval)
        return moved.chunks if moved else {}

    @extend_schema_field(serializers.ChoiceField(choices=IF_APPROVED, allow_null=True))
    def get_if_approved(self, approval: ApprovalRequest) -> str | None:
        moved = self._moved(approval)
        return moved.if_approved if moved else None


def _serialized(principal, approvals, *, many: bool = False):
    """The approvals' API shape, with what moved under their cited evidence read in one query."""
    rows = list(approvals) if many else [approvals]
    ser = ApprovalSerializer(rows if many else approvals, many=many,
                             context={"evidence_moved": evidence_moved(principal=principal, approvals=rows)})
    return ser.data


class DecisionSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(choices=["approve", "reject"])
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")


class ApprovalListApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(
        responses=ApprovalSerializer(many=True),
        parameters=[
            OpenApiParameter("status", enum=ApprovalStatus.values),
            OpenApiParameter("task", OpenApiTypes.UUID),
            OpenApiParameter("tool", str),
        ],
    )
    def get(self, request):
        principal = request_principal(request)
        if not principal.is_approver:
            raise Forbidden(_("only approvers and admins see approvals"))
        status = request.query_params.get("status")
        if status and status not in ApprovalStatus.values:
            raise ValidationError({"status": _("must be one of %(choices)s") % {"choices": ApprovalStatus.values}})
        qs = approval_list(principal=principal, status=status)
        if task_id := request.query_params.get("task"):
            qs = qs.filter(task_id=task_id) if _is_uuid(task_id) else qs.none()
        if tool := request.query_params.get("tool"):
            qs = qs.filter(tool=tool[:64])
        return Response(_serialized(principal, qs[:100], many=True))


class ApprovalDetailApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=ApprovalSerializer)
    def get(self, request, approval_id):
        principal = request_principal(request)
        approval = approval_get(principal=principal, approval_id=approval_id)
        if approval is None:
            raise NotFound(_("approval not found"))
        return Response(_serialized(principal, approval))


class ApprovalDecisionApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(request=DecisionSerializer, responses={200: ApprovalSerializer})
    def post(self, request, approval_id):
        ser = DecisionSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        approval = approval_decide(principal=request_principal(request), approval_id=approval_id,
                                   **ser.validated_data)
        approval.refresh_from_db()
        return Response(ApprovalSerializer(approval).data)


def _is_uuid(value: str) -> bool:
    import uuid

    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
