from __future__ import annotations

import copy

from django.conf import settings
from django.urls import reverse
from django.utils.translation import gettext as _
from rest_framework import serializers

from apps.tasks.models import Task, Urgency


class TaskCreateSerializer(serializers.Serializer):
    device_id = serializers.IntegerField(min_value=1)
    symptom = serializers.CharField(max_length=4000, trim_whitespace=True)
    urgency = serializers.ChoiceField(choices=Urgency.choices, default=Urgency.NORMAL)


class TaskCreateWithFilesSerializer(TaskCreateSerializer):
    """The multipart form of a new request (schema only): the fields above, and up to
    ``ATTACHMENTS_MAX_FILES`` files in ``attachments`` (photos, text logs, PDF; checked by content)."""

    attachments = serializers.ListField(child=serializers.FileField(), required=False)


# A ModelSerializer builds its fields from the model on every instantiation, which cost the submit
# about 0.3 ms of CPU per response (docs/performance.md, "Hot reads in SQL"): the fields are built once
# per class and copied per instance (get_fields), so the schema and the JSON stay the ModelSerializer's.
class TaskSerializer(serializers.ModelSerializer):
    device = serializers.CharField(source="device.asset_tag")
    requester = serializers.CharField(source="requester.username")
    answer = serializers.SerializerMethodField()
    proposal = serializers.SerializerMethodField()
    receipt = serializers.SerializerMethodField()
    approval = serializers.SerializerMethodField()
    waiting_for = serializers.SerializerMethodField()
    questions = serializers.SerializerMethodField()
    limits = serializers.SerializerMethodField()
    attachments = serializers.SerializerMethodField()
    links = serializers.SerializerMethodField()

    class Meta:
        model = Task
        fields = [
            "id", "status", "version", "device", "requester", "symptom", "urgency", "termination_reason",
            "waiting_for", "questions", "answer", "proposal", "approval", "receipt", "budget_total", "budget_used",
            "budget_reserved", "limits", "attachments", "deadline_at", "artifact_bundle", "created_at", "updated_at",
            "links",
        ]

    def get_fields(self) -> dict:
        """The ModelSerializer's fields, built from the model once per class; each instance binds
        its own copy of each (binding sets the field's name, parent and source on the copy; this
        serializer only renders, so nothing else of a field is changed)."""
        cls = type(self)
        built = cls.__dict__.get("_built_fields")
        if built is None:
            built = super().get_fields()
            cls._built_fields = built
        return {name: copy.copy(field) for name, field in built.items()}

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

    def get_attachments(self, obj: Task) -> list[dict]:
        """The files attached to the report, as recorded in ``task.accepted``: ``[{"name",
        "content_type", "size", "sha256", "url"}]`` (``url``: the API address of its bytes)."""
        base = settings.FAULTDESK["PUBLIC_BASE_URL"].rstrip("/")
        return [{k: a[k] for k in ("name", "content_type", "size", "sha256")}
                | {"url": base + reverse("api-task-attachment", args=[obj.pk, a["sha256"]])}
                for a in ((obj.state or {}).get("request") or {}).get("attachments") or []]

    def get_waiting_for(self, obj: Task) -> str | None:
        """What the task waits for, in the reader's language; None when it waits for nothing."""
        waits = {
            "WAITING_INPUT": _("requester input"),
            "WAITING_APPROVAL": _("an approver's decision"),
            "WAITING_RECONCILIATION": _("reconciliation of an unknown outcome"),
            "COMPENSATING": _("the compensation (closing the ticket created before the cancel): its approval or "
                              "its delivery"),
            "WAITING_COMPENSATION": _("an admin's decision on the failed compensation"),
        }.get(obj.status)
        return None if waits is None else str(waits)

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
