"""Action identity at the edges (DESIGN.md §6): one key is one logical action — the same key with
different parameters is refused before any outbox row is written — and a dispatch queued twice sends
one request."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from apps.actions.models import Action, ActionAttempt
from apps.agent import intent
from apps.agent.runner import agent_run, context_read
from apps.approvals.models import ApprovalPolicy
from apps.events.models import RefusedEvent
from apps.outbox import dispatch as outbox
from apps.outbox.models import OutboxMessage
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p, reads_run
from tests.factories import DeviceFactory


@pytest.fixture
def auto_approve(tenant):
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "ticket.create": {"requires_approval": False, "ttl_minutes": 60}})


def test_the_same_key_with_other_parameters_is_refused_before_any_outbox_row(
        requester, device, kb, refservice, refadmin, auto_approve, monkeypatch):
    monkeypatch.setattr(intent, "idempotency_key", lambda **kw: "acme:ticket.create:fixed")
    first = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    assert drive(first.pk).status == reducer.COMPLETED
    other = DeviceFactory(tenant=device.tenant, asset_tag="PRN-0102")
    second = task_submit(principal=p(requester), device_id=other.pk, symptom="Paper jams at the fuser exit.").task
    second = drive(second.pk)
    assert second.status == reducer.FAILED
    assert second.termination_reason == "idempotency key reused: the intent was refused"
    refused = RefusedEvent.objects.get(task=second, type="intent.committed")
    assert "already bound to action" in refused.reason and "other parameters" in refused.reason
    assert not Action.objects.filter(task=second).exists()
    assert not OutboxMessage.objects.filter(action__task=second).exists()
    assert refadmin.requests("acme:ticket.create:fixed") == 1 and len(refadmin.tickets()) == 1


@pytest.mark.django_db(transaction=True)
def test_a_dispatch_queued_twice_sends_one_request(requester, device, kb, refservice, refadmin, auto_approve):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    for _ in range(4):
        agent_run(task_id=task.pk)
        context_read(task_id=task.pk)
        reads_run(task.pk)
    assert Task.objects.get(pk=task.pk).status == reducer.DISPATCHING
    action = Action.objects.get(task=task)
    barrier = threading.Barrier(2)
    outcomes = []

    def dispatcher():
        try:
            barrier.wait()
            outcomes.append(outbox.outbox_dispatch_batch())
        finally:
            connection.close()

    threads = [threading.Thread(target=dispatcher) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == [0, 1], "one dispatcher claimed the row, the other found nothing to claim"
    assert ActionAttempt.objects.filter(action=action).count() == 1
    assert refadmin.requests(action.idempotency_key) == 1 and refadmin.effects(action.idempotency_key) == 1
    assert drive(task.pk).status == reducer.COMPLETED


def test_key_retention_must_cover_deadline_reconciliation_and_restore(settings):
    from django.core.checks import run_checks

    assert not [e for e in run_checks() if e.id == "faultdesk.E001"]
    settings.FAULTDESK = {**settings.FAULTDESK, "IDEMPOTENCY_KEY_RETENTION_DAYS": 20, "RESTORE_WINDOW_DAYS": 30}
    [error] = [e for e in run_checks() if e.id == "faultdesk.E001"]
    assert "shorter than the 33.0 days" in error.msg
