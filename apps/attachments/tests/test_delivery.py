"""Attachment delivery's calls to the ticket system are recorded as the tenant's and the task's."""

from __future__ import annotations

from apps.attachments.delivery import deliveries_drain
from apps.attachments.tests.test_retention import _sent
from apps.gateway.models import GatewayCall
from config.logs import clear


def test_each_attachment_send_is_recorded_with_its_tenant_and_task(client, requester, approver, device, kb,
                                                                  refservice):
    task = _sent(client, requester, approver, device)
    clear()  # as at the start of the Celery task that drains them: nothing bound from the report's run
    assert deliveries_drain() == 2
    sends = GatewayCall.objects.filter(method="PUT", path__contains="/attachments/")
    assert sends.count() == 2
    assert {(row.tenant_id, row.task_id) for row in sends} == {(task.tenant_id, task.pk)}
