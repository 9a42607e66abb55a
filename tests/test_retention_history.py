"""The retention purge over a large generated history keeps every guarantee (DESIGN.md §13
"Retention"): every task still replays (to its row, or as "purged" with its event skeleton
checked), an unknown outcome older than any retention is still reconciled by its key, and an
action inside the idempotency window sent again after a "restore" is a replay, not a second
ticket. The history is real tasks copied with new ids and ages (tools/bench/history.py)."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from apps.actions.audit import task_actions_audit
from apps.actions.models import Action, ActionAttempt, ActionStatus
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.outbox.models import OutboxMessage
from apps.retention.purge import purge_run
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.replay import task_replay
from apps.tasks.services import task_cancel, task_submit
from tests.conftest import drive, p
from tools.bench.history import clone_history

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
COPIES = 150  # x 3 templates = 450 generated tasks, ages 0..400 days


def _submit(requester, device, symptom=SYMPTOM):
    return task_submit(principal=p(requester), device_id=device.pk, symptom=symptom, urgency="high").task


def _approve(approver, task):
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")


def _age(task, days):
    then = timezone.now() - timedelta(days=days)
    Task.objects.filter(pk=task.pk).update(updated_at=then)  # created_at is the day its budget is charged to
    Action.objects.filter(task=task).update(created_at=then)
    ActionAttempt.objects.filter(action__task=task).update(started_at=then, finished_at=then)
    OutboxMessage.objects.filter(action__task=task).update(created_at=then, delivered_at=then)


@pytest.mark.django_db(transaction=True)
def test_a_purge_over_a_large_history_keeps_replay_reconciliation_and_idempotency(
        requester, approver, device, kb, refservice, refadmin, settings):
    from apps.agent.runner import agent_run
    from apps.outbox.dispatch import outbox_dispatch_batch

    # the templates: a completed task with its ticket, a cancelled one, one waiting for approval
    completed = drive(_submit(requester, device).pk)
    _approve(approver, completed)
    completed = drive(completed.pk)
    assert completed.status == reducer.COMPLETED
    cancelled = _submit(requester, device, "Paper jam in tray 2 again, the printer stops mid-job.")
    task_cancel(principal=p(requester), task_id=cancelled.pk, reason="fixed itself")
    cancelled = drive(cancelled.pk)
    assert cancelled.status == reducer.CANCELLED
    waiting = drive(_submit(requester, device, "The fuser error is back after the restart, pages smear.").pk)
    assert waiting.status == reducer.WAITING_APPROVAL

    # an unknown outcome older than any retention: the ticket was created, the answer was lost
    unknown = drive(_submit(requester, device, "Smeared pages again on the third floor printer today.").pk)
    _approve(approver, unknown)
    agent_run(task_id=unknown.pk)
    refadmin.fault("drop_after_commit")
    outbox_dispatch_batch()
    assert Action.objects.get(task=unknown).status == ActionStatus.UNKNOWN
    _age(unknown, 400)

    ages = [400 * i / COPIES for i in range(COPIES)]
    clones = clone_history([completed, cancelled, waiting], COPIES, ages, now=timezone.now())
    assert len(clones) == 3 * COPIES
    before = {t.pk: task_replay(t) for t in Task.objects.filter(pk__in=clones)}
    assert all(r.ok and not r.purged for r in before.values()), [r for r in before.values() if not r.ok][:3]
    with connection.cursor() as cur:
        cur.execute("SELECT count(*), sum(pg_column_size(payload)) FROM events_taskevent")
        events_before, bytes_before = cur.fetchone()

    runs = []
    while not runs or not runs[-1].complete:
        runs.append(purge_run(batch_size=50))
        assert len(runs) < 10
    purged = Counter(Task.objects.values_list("purged", flat=True))
    # the payloads of finished copies older than 180 days (and past the 35-day key window) are gone,
    # excerpts of those between 30 and 180 days; open tasks keep everything
    expected_payload = sum(1 for a in ages if a > 180) * 2
    expected_excerpts = sum(1 for a in ages if 30 < a <= 180) * 2
    assert purged["payload"] == expected_payload and purged["excerpts"] == expected_excerpts
    assert not Task.objects.filter(status=reducer.WAITING_APPROVAL).exclude(purged="").exists()
    assert Task.objects.get(pk=unknown.pk).purged == ""
    assert sum(r.tasks["payload"] for r in runs) == expected_payload
    with connection.cursor() as cur:
        cur.execute("SELECT count(*), sum(pg_column_size(payload)) FROM events_taskevent")
        events_after, bytes_after = cur.fetchone()
    assert events_after == events_before, "the event skeleton stays: no event row is deleted"
    assert bytes_after < bytes_before

    # replay: every task replays — to its row, or as purged with its skeleton intact
    for task in Task.objects.all():
        result = task_replay(task)
        assert result.ok, result
        assert bool(result.purged) == bool(task.purged)
        assert task_actions_audit(task) == []

    # approvals follow their task: a decided one is purged to its task's level and its binding still
    # audits against what was sent — as purged, never as differing; a pending one is whole
    from apps.approvals.services import approval_binding_audit

    for approval in ApprovalRequest.objects.select_related("task"):
        expected = approval.task.purged if approval.status != ApprovalStatus.PENDING else ""
        assert approval.purged == expected, (approval.pk, approval.status, approval.task.purged)
        audit = approval_binding_audit(approval=approval)
        assert audit.state == ("purged" if expected else "ok" if approval.status == "APPROVED" else "unsent"), audit

    # reconciliation: the 400-day-old unknown outcome is still found by its key
    unknown = drive(unknown.pk)
    action = Action.objects.get(task=unknown)
    assert (unknown.status, action.status) == (reducer.COMPLETED, ActionStatus.SUCCEEDED)
    assert refadmin.effects(action.idempotency_key) == 1

    # idempotency: the completed template is 20 days old — its excerpts are gone, its outbox row
    # and attempts kept; a restore that brings its send back is a replay of the same ticket
    _age(completed, 40)
    Action.objects.filter(task=completed).update(updated_at=timezone.now() - timedelta(days=20),
                                                 created_at=timezone.now() - timedelta(days=20))
    purge_run()
    assert Task.objects.get(pk=completed.pk).purged == "excerpts"
    action = Action.objects.get(task=completed)
    assert OutboxMessage.objects.filter(action=action).exists() and ActionAttempt.objects.filter(action=action).exists()
    # the send a restored backup would make again: the same key, the same parameters, a later fencing token
    from apps.tickets.connectors import connector_for

    message = OutboxMessage.objects.get(action=action)
    receipt = connector_for(action.tool, action.connector).execute(
        tool=action.tool, idempotency_key=action.idempotency_key, fencing_token=message.lease_generation + 1,
        params=action.params, timeout=5)
    assert receipt.external_id == action.external_id and receipt.replayed is True
    assert refadmin.effects(action.idempotency_key) == 1
    assert len([t for t in refadmin.tickets() if t["idempotency_key"] == action.idempotency_key]) == 1
