"""The task API's serializer builds its ModelSerializer fields once per class and binds a copy of
each per instance: its JSON, for one task or many, and its OpenAPI schema are the ModelSerializer's."""

from __future__ import annotations

from rest_framework import serializers
from rest_framework.renderers import JSONRenderer

from apps.tasks.api.serializers import TaskSerializer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_submit
from tests.conftest import drive, p


class _Built(TaskSerializer):
    """The same serializer building its fields from the model every time (the ModelSerializer's own)."""

    def get_fields(self):
        return serializers.ModelSerializer.get_fields(self)


def test_the_json_is_the_model_serializers_for_tasks_in_several_states(requester, device, kb, refservice):
    waiting = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                                symptom="Fuser error after warm-up, 打印出来的纸上碳粉没有定影").task.pk)
    cancelled = task_cancel(principal=p(requester), task_id=task_submit(
        principal=p(requester), device_id=device.pk, symptom="toner low").task.pk, reason="fixed itself")
    fresh = task_submit(principal=p(requester), device_id=device.pk, symptom="paper jam").task
    tasks = list(Task.objects.select_related("device", "requester").filter(pk__in=[waiting.pk, cancelled.pk, fresh.pk]))
    assert len({t.status for t in tasks}) == 3
    render = JSONRenderer().render
    for task in tasks:
        assert render(TaskSerializer(task).data) == render(_Built(task).data)
        assert render(TaskSerializer(task).data) == render(TaskSerializer(task).data)  # nothing leaks between uses
    assert render(TaskSerializer(tasks, many=True).data) == render(_Built(tasks, many=True).data)


def test_each_instance_binds_its_own_fields():
    first, second = TaskSerializer(), TaskSerializer()
    assert first.fields["status"] is not second.fields["status"]
    assert first.fields["status"].parent is first and second.fields["status"].parent is second
    assert list(first.fields) == TaskSerializer.Meta.fields
