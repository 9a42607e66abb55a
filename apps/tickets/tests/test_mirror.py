"""The ticket mirror written from receipts in one statement (``mirrors_record_created``): a row per
action with the receipt's ticket, overwritten when the action's row exists, and refused when another
action's row already names that ticket."""

from __future__ import annotations

import uuid

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.actions.registry import tool_get
from apps.actions.services import action_create
from apps.tasks.services import task_submit
from apps.tickets.connectors import Receipt
from apps.tickets.models import TicketMirror
from apps.tickets.services import mirrors_record_created
from tests.conftest import p


def _receipt(ticket: str, version: int, status: str = "open") -> Receipt:
    return Receipt(connector="reference", external_id=ticket, version=version, status=status, replayed=False,
                   body={"id": ticket, "title": "卡纸 jam", "version": version})


@pytest.fixture
def actions(requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="paper jam").task
    return [action_create(action_id=uuid.uuid4(), tenant_id=task.tenant_id, task_id=task.pk,
                          tool=tool_get("ticket.create"), connector="reference", params={"title": key},
                          params_digest="d" * 64, idempotency_key=key, object_version=1) for key in ("k1", "k2")]


def test_mirrors_are_written_then_overwritten_by_a_later_receipt(actions):
    a, b = actions
    now = timezone.now()
    mirrors_record_created([(a, _receipt("T-1", 1)), (b, _receipt("T-2", 1))], now=now)
    mirrors_record_created([(a, _receipt("T-1", 2, "resolved"))], now=now)
    got = {m.action_id: m for m in TicketMirror.objects.all()}
    assert (got[a.pk].external_id, got[a.pk].external_version, got[a.pk].status) == ("T-1", 2, "resolved")
    assert got[a.pk].data == {"id": "T-1", "title": "卡纸 jam", "version": 2}
    assert (got[b.pk].external_id, got[b.pk].tenant_id, got[b.pk].updated_at) == ("T-2", b.tenant_id, now)


def test_a_ticket_already_mirrored_for_another_action_is_refused(actions):
    a, b = actions
    mirrors_record_created([(a, _receipt("T-1", 1))], now=timezone.now())
    with pytest.raises(IntegrityError), transaction.atomic():
        mirrors_record_created([(b, _receipt("T-1", 1))], now=timezone.now())
    assert TicketMirror.objects.count() == 1
