"""Retention of approvals' copies (apps/approvals/retention.py, migration 0007, ADR 0020): the purge
empties the evidence excerpts and the free text an approval keeps once its task is purged, keeps
what proves the binding, and the database refuses every other change of an approval."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.urls import reverse
from django.utils import timezone

from apps.actions.models import Action
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import (
    PURGED,
    SHOWN_DIFFERS,
    approval_binding_audit,
    approval_check_binding,
    approval_decide,
)
from apps.retention.purge import purge_run
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.aging import age_finished_task as _age
from tests.conftest import drive, p
from tests.tamper import immutability_bypassed

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _completed(requester, approver, device) -> tuple[Task, ApprovalRequest]:
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    approval.refresh_from_db()
    return task, approval


def _binding(a: ApprovalRequest) -> tuple:
    return (a.tool, a.tool_version, a.action_digest, a.object_type, a.object_id, a.object_version,
            a.policy_version, a.scope, a.side_effects, a.status, a.decided_by_id, a.decided_at, a.reason,
            a.expires_at)


def _refused(sql: str, params=()) -> str:
    """Run ``sql`` in a savepoint; return the database's refusal (fails when it is let through)."""
    with pytest.raises(IntegrityError) as caught, transaction.atomic(), connection.cursor() as cur:
        cur.execute(sql, list(params))
    return str(caught.value)


def test_a_purged_tasks_approval_loses_its_text_and_keeps_its_binding(
        requester, approver, device, kb, refservice, client, admin_user):
    task, approval = _completed(requester, approver, device)
    assert approval.params["title"] and approval.params["description"]
    assert any(e["excerpt"] for e in approval.evidence)
    kept = _binding(approval)
    assert approval_binding_audit(approval=approval).state == "ok"
    _age(task, 200)
    run = purge_run()
    assert run.tables["approvals_approvalrequest"]["rows"] == 1
    assert run.tables["approvals_approvalrequest"]["bytes"] > 0
    approval.refresh_from_db()
    assert (approval.purged, approval.purged_at is not None) == ("payload", True)
    assert _binding(approval) == kept
    assert approval.params["title"] == "" and approval.params["description"] == ""
    assert approval.params["priority"] and approval.params["device"]  # the structured values stay
    assert all(e["excerpt"] == "" for e in approval.evidence)
    assert all(e["chunk_id"] and e["content_digest"] for e in approval.evidence)  # the references stay
    assert SYMPTOM not in str(approval.params)
    # the binding is still checked against what was sent, and reported as purged, not as changed
    audit = approval_binding_audit(approval=approval)
    assert audit.state == "purged" and PURGED in audit.reason
    check = approval_check_binding(approval=approval, action_digest=approval.action_digest,
                                   object_version=approval.object_version)
    assert (check.ok, check.purged, check.reason) == (False, True, PURGED)
    assert check.reason != SHOWN_DIFFERS
    # a digest that differs from what the approval binds is still caught
    with immutability_bypassed("actions_action"):
        Action.objects.filter(task=task).update(params_digest="0" * 64)
    assert approval_binding_audit(approval=approval).state == "differs"
    # the queue shows the decision and says what was purged
    client.force_login(admin_user)
    page = client.get(reverse("approval-queue") + "?status=APPROVED").content.decode()
    assert 'data-purged="payload"' in page and "under the retention policy" in page
    # nothing left to do
    assert "approvals_approvalrequest" not in purge_run().tables


def test_excerpts_go_first_and_the_parameters_follow_at_the_payload_level(requester, approver, device, kb,
                                                                          refservice):
    task, approval = _completed(requester, approver, device)
    title = approval.params["title"]
    _age(task, 40)
    purge_run()
    approval.refresh_from_db()
    assert approval.purged == "excerpts" and all(e["excerpt"] == "" for e in approval.evidence)
    assert approval.params["title"] == title
    _age(task, 200)
    Action.objects.filter(task=task).update(created_at=timezone.now() - timedelta(days=200))
    purge_run()
    approval.refresh_from_db()
    assert approval.purged == "payload" and approval.params["title"] == ""


def test_the_task_batch_takes_its_approvals_and_the_catch_up_takes_what_a_batch_left(
        requester, approver, device, kb, refservice, monkeypatch):
    from apps.approvals import retention as approval_retention
    from apps.core.retention import PurgeCounts

    first, left = _completed(requester, approver, device)
    _age(first, 200)
    # a task purged before its approvals were (an older build, or the approval row locked then)
    monkeypatch.setattr(approval_retention, "purge_task_approvals", lambda ids, level, at: PurgeCounts())
    monkeypatch.setattr(approval_retention, "purge_approvals_batch", lambda *a, **kw: approval_retention.Purged())
    purge_run()
    left.refresh_from_db()
    assert Task.objects.get(pk=first.pk).purged == "payload" and left.purged == ""
    monkeypatch.undo()
    second, taken = _completed(requester, approver, device)
    _age(second, 200)
    run = purge_run()
    assert run.tables["approvals_approvalrequest"]["rows"] == 2
    assert [r.tasks for r in run.records] == [{"excerpts": 0, "payload": 1}]
    for a in (left, taken):
        a.refresh_from_db()
        assert a.purged == "payload" and all(a.params.get(k, "") == "" for k in ("title", "description", "body"))


def test_a_pending_approval_and_the_approval_of_an_unpurged_task_are_left(requester, approver, device, kb,
                                                                         refservice):
    waiting = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    pending = ApprovalRequest.objects.get(task=waiting)
    _task, recent = _completed(requester, approver, device)  # finished today: nothing is due
    Task.objects.filter(pk=waiting.pk).update(updated_at=timezone.now() - timedelta(days=400))
    purge_run()
    for a in (pending, recent):
        before = (a.params, a.evidence)
        a.refresh_from_db()
        assert (a.purged, a.params, a.evidence) == ("", *before)


def test_the_trigger_admits_the_purge_and_refuses_every_other_change(requester, approver, device, kb, refservice):
    task, approval = _completed(requester, approver, device)
    table, pk = "approvals_approvalrequest", approval.pk
    purge = ("UPDATE approvals_approvalrequest SET params = faultdesk_approval_purged_params(params, %s), "
             "evidence = faultdesk_approval_purged_evidence(evidence, %s), purged = %s, purged_at = now() "
             "WHERE id = %s")
    # its task is not purged yet: the copy stays
    assert "its task is not purged" in _refused(purge, ["payload", "payload", "payload", pk])
    Task.objects.filter(pk=task.pk).update(purged="payload", purged_at=timezone.now())
    # the binding never moves: h(a), the tool, the object version
    assert "action_digest" in _refused(f"UPDATE {table} SET action_digest = %s WHERE id = %s", ["f" * 64, pk])
    assert "object_version" in _refused(f"UPDATE {table} SET object_version = object_version + 1 WHERE id = %s",
                                        [pk])
    # a partial change of the copy, marked as a purge or not
    partial = f"UPDATE {table} SET params = jsonb_set(params, '{{title}}', '\"\"'), purged = %s, purged_at = now() " \
              "WHERE id = %s"
    assert "empties exactly" in _refused(partial, ["payload", pk])
    assert "cannot change" in _refused(f"UPDATE {table} SET params = jsonb_set(params, '{{title}}', '\"\"') "
                                       "WHERE id = %s", [pk])
    assert "cannot change" in _refused(f"UPDATE {table} SET evidence = '[]' WHERE id = %s", [pk])
    # the purge with a change of its decision
    assert "not its decision" in _refused(purge.replace("purged_at = now()", "purged_at = now(), status = 'REJECTED'"),
                                          ["payload", "payload", "payload", pk])
    # the purge itself
    with connection.cursor() as cur:
        cur.execute(purge, ["payload", "payload", "payload", pk])
    approval.refresh_from_db()
    assert approval.purged == "payload" and approval.params["title"] == ""
    # after it: no status change, no second purge at the same or a lower level, no copy put back
    assert "decision cannot change" in _refused(f"UPDATE {table} SET status = 'INVALIDATED' WHERE id = %s", [pk])
    assert "cannot change" in _refused(purge, ["excerpts", "excerpts", "excerpts", pk])
    assert "cannot change" in _refused(f"UPDATE {table} SET params = jsonb_set(params, '{{title}}', '\"x\"') "
                                       "WHERE id = %s", [pk])
    # an UPDATE that changes nothing still goes through (e.g. a save of the same values)
    with connection.cursor() as cur:
        cur.execute(f"UPDATE {table} SET status = status WHERE id = %s", [pk])


def test_a_pending_approval_is_never_purged_even_when_its_task_row_says_so(requester, device, kb):
    waiting = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval = ApprovalRequest.objects.get(task=waiting)
    Task.objects.filter(pk=waiting.pk).update(purged="payload", purged_at=timezone.now())
    message = _refused("UPDATE approvals_approvalrequest SET params = faultdesk_approval_purged_params(params, "
                       "'payload'), purged = 'payload', purged_at = now() WHERE id = %s", [approval.pk])
    assert "pending" in message


def test_an_approval_cannot_be_created_already_purged(requester, device, kb):
    """The purge marks come only from the one UPDATE the copy guard checks: a copy inserted with them
    would pass the binding audit as purged instead of as differing."""
    waiting = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval = ApprovalRequest.objects.get(task=waiting)
    columns = [f.column for f in ApprovalRequest._meta.concrete_fields if f.column != "id"]
    for column, value in (("purged", "'payload'"), ("purged_at", "now()")):
        copy = ", ".join(value if c == column else c for c in columns)
        message = _refused(f"INSERT INTO approvals_approvalrequest ({', '.join(columns)}) "  # noqa: S608
                           f"SELECT {copy} FROM approvals_approvalrequest WHERE id = %s", [approval.pk])
        assert "created unpurged" in message
    assert ApprovalRequest.objects.filter(task=waiting).count() == 1
