"""A device that leaves the tenant after the request (moved to another tenant, or deleted) ends
the task with "device no longer exists in the tenant" at the next device read — never a loop of
retries that spends the task's budget."""

from __future__ import annotations

import pytest

from apps.devices.models import Device
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.factories import TenantFactory

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.mark.allow_divergence  # nothing diverges; the other tenant's device is out of this task's reach
def test_a_device_moved_to_another_tenant_fails_the_task_at_once(requester, device, kb, refservice):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task
    Device.objects.filter(pk=device.pk).update(tenant=TenantFactory(slug="elsewhere"))
    task = drive(task.pk)
    assert task.status == reducer.FAILED
    assert task.termination_reason == "device no longer exists in the tenant"
    assert TaskEvent.objects.filter(task=task).count() < 10
    assert task.budget_reserved == 0
