"""The chaos run's final check (``tools.chaos.check``) must be able to fail: each figure it gates
on — lost tasks, duplicate effects, replay divergences — is shown non-zero here for a planted fault,
and zero for a clean run, against the real reference ticket service."""

from __future__ import annotations

import json

import pytest

from apps.actions.models import Action, ActionStatus
from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from apps.tickets.connectors import ReferenceTicketConnector
from tests.conftest import drive, p
from tools import chaos


@pytest.fixture
def completed(requester, approver, device, kb, refservice, tmp_path, monkeypatch):
    monkeypatch.setattr(chaos, "CHAOS_DIR", tmp_path)
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    task = drive(task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == "COMPLETED"
    return task


def _check(capsys, tmp_path, ids) -> dict:
    (tmp_path / "accepted.json").write_text(json.dumps({"reference": [str(i) for i in ids]}))
    chaos.check()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["reference"]


def test_a_clean_run_has_nothing_to_report(completed, capsys, tmp_path):
    figures = _check(capsys, tmp_path, [completed.pk])
    assert figures | {"remote_effects": 1, "comments": 0, "conflicts": 0} == figures
    assert (figures["tasks"], figures["completed"], figures["lost"], figures["duplicate_effects"],
            figures["replay_divergences"], figures["unreconciled"]) == (1, 1, 0, 0, 0, 0)


@pytest.mark.allow_divergence
def test_planted_faults_are_counted(completed, capsys, tmp_path, requester, device):
    # A second effect for the same task: another action of the task whose ticket exists remotely.
    first = Action.objects.get(task=completed)
    extra = Action.objects.create(tenant_id=first.tenant_id, task_id=completed.pk, tool=first.tool,
                                  tool_version=first.tool_version, params=first.params,
                                  params_digest=first.params_digest, idempotency_key=first.idempotency_key + "-2",
                                  object_version=first.object_version, status=ActionStatus.NOT_SENT)
    ReferenceTicketConnector().create_ticket(idempotency_key=extra.idempotency_key, fencing_token=1,
                                             params=first.params)
    # A task stuck in a running state, and one the API accepted that does not exist.
    stuck = task_submit(principal=p(requester), device_id=device.pk, symptom="Toner smears on every page.").task
    missing = "00000000-0000-0000-0000-000000000000"
    figures = _check(capsys, tmp_path, [completed.pk, stuck.pk, missing])
    assert figures["tasks"] == 3 and figures["lost"] == 2
    assert figures["duplicate_effects"] == 1
    # The completed task's record disagrees with the ticket system (a ticket for a NOT_SENT action).
    assert figures["replay_divergences"] == 1
    assert Task.objects.get(pk=stuck.pk).status == "ACCEPTED"


@pytest.mark.allow_divergence
def test_a_task_still_waiting_for_reconciliation_is_counted(completed, capsys, tmp_path):
    """After the settle time every reconciliation should be done (each ticket system answers a
    lookup by key): one still waiting is counted, and the run fails on it."""
    Task.objects.filter(pk=completed.pk).update(status="WAITING_RECONCILIATION")
    figures = _check(capsys, tmp_path, [completed.pk])
    assert figures["unreconciled"] == 1 and figures["lost"] == 0
