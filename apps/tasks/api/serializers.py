from __future__ import annotations

from django.conf import settings
from django.urls import reverse
from rest_framework import serializers

from apps.tasks.models import Task, Urgency


class TaskCreateSerializer(serializers.Serializer):
    device_id = serializers.IntegerField(min_value=1)
    symptom = serializers.CharField(max_length=4000, trim_whitespace=True)
    urgency = serializers.ChoiceField(choices=Urgency.choices, default=Urgency.NORMAL)


class TaskSerializer(serializers.Serializer):
    """A task as the API returns it. Fields are declared, not introspected from the model: a
    ``ModelSerializer`` builds its fields from the model on every instantiation, which cost the
    submit about 0.5 ms of CPU per response (docs/performance.md, "Hot reads in SQL")."""

    id = serializers.UUIDField(read_only=True)
    status = serializers.ChoiceField(choices=Task._meta.get_field("status").choices, read_only=True)
    version = serializers.IntegerField(read_only=True)
    symptom = serializers.CharField(read_only=True)
    urgency = serializers.ChoiceField(choices=Urgency.choices, read_only=True)
    termination_reason = serializers.CharField(read_only=True)
    budget_total = serializers.IntegerField(read_only=True)
    budget_used = serializers.IntegerField(read_only=True)
    budget_reserved = serializers.IntegerField(read_only=True)
    deadline_at = serializers.DateTimeField(read_only=True)
    artifact_bundle = serializers.JSONField(read_only=True)
    created_at = serializers.DateTimeField(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)
    device = serializers.CharField(source="device.asset_tag")
    requester = serializers.CharField(source="requester.username")
    answer = serializers.SerializerMethodField()
    proposal = serializers.SerializerMethodField()
    receipt = serializers.SerializerMethodField()
    approval = serializers.SerializerMethodField()
    waiting_for = serializers.SerializerMethodField()
    questions = serializers.SerializerMethodField()
    limits = serializers.SerializerMethodField()
    links = serializers.SerializerMethodField()

    #: the order of the fields in a response (as before the fields were declared)
    FIELD_ORDER = (
        "id", "status", "version", "device", "requester", "symptom", "urgency", "termination_reason",
        "waiting_for", "questions", "answer", "proposal", "approval", "receipt", "budget_total", "budget_used",
        "budget_reserved", "limits", "deadline_at", "artifact_bundle", "created_at", "updated_at", "links",
    )

    def get_fields(self) -> dict:
        fields = super().get_fields()
        return {name: fields[name] for name in self.FIELD_ORDER}

    def get_answer(self, obj: Task) -> dict | None:
        return obj.state.get("answer")

    def get_proposal(self, obj: Task) -> dict | None:
        return obj.state.get("proposal")

    def get_receipt(self, obj: Task) -> dict | None:
        return obj.state.get("receipt")

    def get_approval(self, obj: Task) -> dict | None:
        return obj.state.get("approval")

    def get_questions(self, obj: Task) -> list[str] | None:
        return obj.state.get("questions")

    def get_limits(self, obj: Task) -> dict | None:
        """``reducer/3``: ``{"tokens"|"tool_calls"|"retries": {"total", "used", "reserved"},
        "open_reservations": n}``; None for older tasks."""
        limits = obj.state.get("limits")
        if limits is None:
            return None
        return {**limits, "open_reservations": len(obj.state.get("reservations") or {})}

    def get_waiting_for(self, obj: Task) -> str | None:
        return {
            "WAITING_INPUT": "requester input",
            "WAITING_APPROVAL": "an approver's decision",
            "WAITING_RECONCILIATION": "reconciliation of an unknown outcome",
            "COMPENSATING": "the compensation (closing the ticket created before the cancel): its approval or "
                            "its delivery",
            "WAITING_COMPENSATION": "an admin's decision on the failed compensation",
        }.get(obj.status)

    def get_links(self, obj: Task) -> dict:
        base = settings.FAULTDESK["PUBLIC_BASE_URL"].rstrip("/")
        return {
            "self": base + reverse("api-task-detail", args=[obj.pk]),
            "page": base + reverse("task-detail", args=[obj.pk]),
            "trace": base + reverse("task-trace", args=[obj.pk]),
        }


class EventSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    type = serializers.CharField()
    payload = serializers.JSONField()
    payload_digest = serializers.CharField()
    occurred_at = serializers.DateTimeField()
    recorded_at = serializers.DateTimeField()
    actor = serializers.CharField()
    lease_generation = serializers.IntegerField(allow_null=True)


class CancelSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class InputSerializer(serializers.Serializer):
    text = serializers.CharField(max_length=4000)
