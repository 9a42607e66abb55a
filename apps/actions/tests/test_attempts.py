"""Attempt rows written and closed in one statement for a batch (``attempts_start``,
``attempts_close_with_receipt``): numbered after the action's earlier attempts, each with its
fencing token and worker; on a receipt, the attempt that brought it ends RECEIPT and any other of
the action's attempts still in flight ends UNKNOWN (it may be the one that created the ticket),
while finished attempts and other actions' attempts are left as they are."""

from __future__ import annotations

import uuid

import pytest
from django.db import transaction
from django.utils import timezone

from apps.actions.models import Action, ActionAttempt, AttemptOutcome
from apps.actions.registry import tool_get
from apps.actions.services import ORPHANED_ATTEMPT, action_create, attempts_close_with_receipt, attempts_start
from apps.tasks.services import task_submit
from tests.conftest import p


def _action(task, key: str) -> Action:
    return action_create(action_id=uuid.uuid4(), tenant_id=task.tenant_id, task_id=task.pk,
                         tool=tool_get("ticket.create"), connector="reference", params={"title": key},
                         params_digest="d" * 64, idempotency_key=key, object_version=1)


@pytest.fixture
def actions(requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="toner low").task
    return _action(task, "key-a"), _action(task, "key-b")


def test_attempts_are_numbered_after_the_actions_earlier_ones(actions):
    a, b = actions
    now = timezone.now()
    first = attempts_start([(a, 3), (b, 1)], worker="w1", now=now)
    assert {k: (v.number, v.fencing_token) for k, v in first.items()} == {a.pk: (1, 3), b.pk: (1, 1)}
    second = attempts_start([(a, 4)], worker="w2", now=now)
    assert second[a.pk].number == 2
    rows = {(r.action_id, r.number): r for r in ActionAttempt.objects.all()}
    assert len(rows) == 3
    assert (rows[(a.pk, 2)].fencing_token, rows[(a.pk, 2)].worker, rows[(a.pk, 2)].outcome) == \
        (4, "w2", AttemptOutcome.IN_FLIGHT)
    assert rows[(a.pk, 2)].pk == second[a.pk].pk and rows[(a.pk, 2)].started_at == now


def test_an_action_named_twice_writes_nothing(actions):
    a, _ = actions
    with pytest.raises(ValueError):
        attempts_start([(a, 1), (a, 2)], worker="w", now=timezone.now())
    assert not ActionAttempt.objects.exists()


def test_a_receipt_closes_its_attempt_and_orphans_the_actions_other_in_flight_ones(actions):
    a, b = actions
    now = timezone.now()
    stalled = attempts_start([(a, 1)], worker="dead", now=now)[a.pk]
    failed = attempts_start([(a, 2)], worker="w", now=now)[a.pk]
    ActionAttempt.objects.filter(pk=failed.pk).update(outcome=AttemptOutcome.RETRYABLE, error={"code": "busy"})
    mine = attempts_start([(a, 3), (b, 1)], worker="w", now=now)
    with transaction.atomic():
        attempts_close_with_receipt(action_ids=[a.pk], attempt_ids=[mine[a.pk].pk], now=now)
    got = {r.pk: r for r in ActionAttempt.objects.all()}
    assert (got[mine[a.pk].pk].outcome, got[mine[a.pk].pk].error, got[mine[a.pk].pk].finished_at) == \
        (AttemptOutcome.RECEIPT, None, now)
    assert (got[stalled.pk].outcome, got[stalled.pk].error) == (AttemptOutcome.UNKNOWN, ORPHANED_ATTEMPT)
    assert (got[failed.pk].outcome, got[failed.pk].error) == (AttemptOutcome.RETRYABLE, {"code": "busy"})
    assert (got[mine[b.pk].pk].outcome, got[mine[b.pk].pk].finished_at) == (AttemptOutcome.IN_FLIGHT, None)
