"""Reconciliation API (DESIGN.md §6): the tenant's unknown actions and a
person's resolution of one; failed compensations and a person's decision on one. Admins only;
another tenant's action or task is 404."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.api import HasPrincipal, request_principal
from apps.actions.api.serializers import AttemptSerializer
from apps.actions.models import Action
from apps.outbox.reconciliation import reconciliation_list, reconciliation_resolve
from apps.tasks.compensation import compensation_settle, compensations_waiting
from apps.tasks.models import Task


class UnknownActionSerializer(serializers.ModelSerializer):
    task_id = serializers.UUIDField(source="task.id")
    device = serializers.CharField(source="task.device.asset_tag")
    attempts = AttemptSerializer(many=True)

    class Meta:
        model = Action
        fields = ["id", "task_id", "device", "tool", "tool_version", "params", "params_digest", "idempotency_key",
                  "status", "external_id", "last_error", "reconcile_attempts", "last_reconcile_error",
                  "last_reconciled_at", "attempts", "created_at"]


class ResolutionSerializer(serializers.Serializer):
    executed = serializers.BooleanField()
    external_id = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")
    note = serializers.CharField(max_length=1000)


class ReconciliationListApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=UnknownActionSerializer(many=True))
    def get(self, request):
        rows = reconciliation_list(principal=request_principal(request))
        data = []
        for r in rows:
            item = UnknownActionSerializer(r.action).data
            item.update(needs_person=r.needs_person, why=r.why)
            data.append(item)
        return Response(data)


class ReconciliationResolveApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(request=ResolutionSerializer, responses={200: UnknownActionSerializer})
    def post(self, request, action_id):
        ser = ResolutionSerializer(data=request.data)
        if not ser.is_valid():
            raise ValidationError(ser.errors)
        action = reconciliation_resolve(principal=request_principal(request), action_id=action_id,
                                        **ser.validated_data)
        return Response(UnknownActionSerializer(action).data)


class WaitingCompensationSerializer(serializers.ModelSerializer):
    device = serializers.CharField(source="device.asset_tag")
    requester = serializers.CharField(source="requester.username")
    compensation = serializers.JSONField(source="state.compensation")
    receipt = serializers.JSONField(source="state.receipt")

    class Meta:
        model = Task
        fields = ["id", "status", "device", "requester", "termination_reason", "receipt", "compensation",
                  "updated_at"]


class CompensationDecisionSerializer(serializers.Serializer):
    decision = serializers.ChoiceField(choices=["retry", "done_by_hand", "not_needed"])
    note = serializers.CharField(max_length=1000)


class CompensationListApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=WaitingCompensationSerializer(many=True))
    def get(self, request):
        tasks = compensations_waiting(principal=request_principal(request))
        return Response(WaitingCompensationSerializer(tasks, many=True).data)


class CompensationDecisionApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(request=CompensationDecisionSerializer, responses={200: WaitingCompensationSerializer})
    def post(self, request, task_id):
        ser = CompensationDecisionSerializer(data=request.data)
        if not ser.is_valid():
            raise ValidationError(ser.errors)
        task = compensation_settle(principal=request_principal(request), task_id=task_id, **ser.validated_data)
        return Response(WaitingCompensationSerializer(task).data)
