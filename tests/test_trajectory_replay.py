"""Trajectory replay as a release gate (apps/agent/trajectories.py; spec §16.11): recorded tasks are
re-driven through a candidate bundle and every divergence in a decision field is printed and fails
the command; describing fields are reported, never failed on."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p

pytestmark = pytest.mark.django_db(transaction=True)

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _run(*args) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("replay_trajectories", *args, stdout=out)
    except CommandError as exc:
        return exc.returncode, out.getvalue() + str(exc)
    return 0, out.getvalue()


@pytest.fixture
def recorded(requester, approver, device, kb, refservice, model_server):
    """Two recorded tasks on the scripted model: one whose model suggested P1 (the rules decided
    otherwise) and was approved and sent; one rejected and then re-worded (refused)."""
    model_server.set_script([
        {"reply": "draft", "overrides": {"priority": "P1", "title": "Fuser error after warm-up"}},
        {"reply": "draft", "overrides": {"title": "Smeared pages after warm-up"}},
        {"reply": "draft", "overrides": {"title": "Pages smeared: the fuser after warm-up"}},
    ])
    first = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="normal").task.pk)
    approval = ApprovalRequest.objects.get(task=first, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    first = drive(first.pk)
    second = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM + " Again.",
                               urgency="normal").task.pk)
    if second.status == reducer.WAITING_APPROVAL:
        approval = ApprovalRequest.objects.get(task=second, status=ApprovalStatus.PENDING)
        approval_decide(principal=p(approver), approval_id=approval.pk, decision="reject", reason="duplicate")
        second = drive(second.pk)
    return first, second


def test_the_current_bundle_replays_the_recorded_decisions_without_divergence(recorded):
    first, second = recorded
    assert first.status == reducer.COMPLETED and first.state["draft"]["outside_rules"][0]["suggested"] == "P1"
    code, out = _run("--bundle", "current")
    assert code == 0, out
    assert f"task {first.pk}: 1 decision point(s), same decisions" in out
    assert "replay_trajectories: tasks=2" in out and "diverged_points=0" in out
    code, out = _run("--bundle", "pinned")
    assert code == 0 and "candidate bundle: {}" in out and "diverged_points=0" in out


def test_the_old_controller_shows_the_priority_and_rejection_divergences_and_fails(recorded):
    first, second = recorded
    code, out = _run("--bundle", "controller=controller/1")
    assert code == 1
    # controller/1 would have taken the model's P1
    assert f"task {first.pk}: 1 decision point(s), DIVERGES" in out
    assert f"priority {first.state['draft']['ticket']['priority']!r} -> 'P1'" in out
    # and would have asked again for the re-worded draft the rejection covers
    assert second.termination_reason == "proposal_rejected"
    assert f"task {second.pk}: 2 decision point(s), DIVERGES" in out
    assert "termination 'proposal_rejected' -> 'proposal'" in out
    assert "diverged_tasks=2 diverged_points=2" in out and "priority=1" in out and "termination=1" in out


def test_a_prompt_change_is_re_asked_live_and_its_effects_reported(recorded, model_server):
    first, _ = recorded
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4", "title": "Another title entirely"}}],
                            default={"reply": "draft"})
    code, out = _run("--bundle", "prompt_template=ticket-draft/2", "--live", "--task", str(first.pk))
    # the rules decide the priority: a prompt that makes the model suggest P4 changes no decision…
    assert code == 0, out
    # …but its re-worded title is reported as a describing change, and the model was really asked with /2
    assert "describing fields changed: title" in out
    sent = model_server.requests[-1]["messages"][0]["content"]
    assert "<attachment>" not in sent and "<request>, <answer>, <device> and <evidence>" in sent


def test_recorded_replies_under_another_prompt_are_marked_and_unknown_parts_refused(recorded):
    first, _ = recorded
    code, out = _run("--bundle", "prompt_template=ticket-draft/2", "--task", str(first.pk))
    assert code == 0 and "model reply recorded under ticket-draft/3" in out
    code, out = _run("--bundle", "prompt_template=ticket-draft/9")
    assert code == 1 and "cannot run in this build" in out and "ticket-draft/9" in out
    code, out = _run("--bundle", "not a bundle")
    assert code == 1 and "key=value" in out
