"""The pinned artifact bundle is honoured or refused (spec §16.11): a task runs with the prompt
template it was pinned to, and a task pinned to a prompt, parser, controller or tool schema this
build does not carry fails explicitly, before it proposes anything, and is never run with the code
the build has now."""

from __future__ import annotations

import pytest

from apps.agent.bundle import bundle_problem
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.events.models import TaskEvent
from apps.llm.drafter import PROMPT_TEMPLATE_VERSION, UnsupportedVersion, render_prompt
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import artifact_bundle_current, task_submit
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
FILES = [{"name": "printer.log", "content_type": "text/plain", "size": 9, "sha256": "0" * 64,
          "text": "ERROR E-203"}]
DEVICE = {"asset_tag": "PRN-1", "kind": "printer", "site": "HQ", "state": "ok", "version": 1}


def test_the_current_bundle_is_carried_whole():
    assert bundle_problem(artifact_bundle_current()) is None
    assert bundle_problem({}) is None  # an older task's bundle pins fewer parts: nothing to refuse


@pytest.mark.parametrize(("part", "value", "words"), [
    ("prompt_template", "ticket-draft/1", "prompt_template 'ticket-draft/1' is not in this build"),
    ("parser", "ticket-draft-parser/0", "parser 'ticket-draft-parser/0'"),
    ("controller", "controller/9", "controller 'controller/9'"),
    ("output_parser", "model-output-parser/7", "output_parser"),
    ("tool_schemas", {"ticket.create": "0"}, "tool schema ticket.create '0'"),
    ("tool_schemas", {"ticket.delete": "1"}, "tool schema ticket.delete '1' is not in this build (it has no such"),
])
def test_each_part_the_build_does_not_carry_is_named(part, value, words):
    assert words in bundle_problem({**artifact_bundle_current(), part: value})


def test_a_prompt_template_is_rendered_as_the_version_the_task_was_pinned_to():
    request = {"symptom": SYMPTOM, "urgency": "high", "attachments": FILES}
    now = render_prompt(request=request, device=DEVICE, evidence=[])
    before = render_prompt(request=request, device=DEVICE, evidence=[], template="ticket-draft/2")
    assert PROMPT_TEMPLATE_VERSION == "ticket-draft/3"
    assert "<attachment" in now[1]["content"] and "<attachment" in now[0]["content"]
    assert "<attachment" not in before[1]["content"] and "<attachment" not in before[0]["content"]
    with pytest.raises(UnsupportedVersion, match="ticket-draft/1"):
        render_prompt(request=request, device=DEVICE, evidence=[], template="ticket-draft/1")


@pytest.mark.parametrize("status_before", ["ACCEPTED", "WAITING_APPROVAL"])
def test_a_task_pinned_to_code_the_build_lacks_fails_explicitly_and_proposes_nothing(
        status_before, requester, device, kb):
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    if status_before == "WAITING_APPROVAL":
        task = drive(task.pk)
        assert task.status == reducer.WAITING_APPROVAL
    Task.objects.filter(pk=task.pk).update(
        artifact_bundle={**task.artifact_bundle, "prompt_template": "ticket-draft/1"})
    task = drive(task.pk)
    assert task.status == reducer.FAILED
    assert task.termination_reason.startswith("bundle_unsupported: prompt_template 'ticket-draft/1'")
    failed = TaskEvent.objects.get(task=task, type="task.failed")
    assert failed.payload["reason"] == task.termination_reason
    if status_before == "ACCEPTED":
        assert not TaskEvent.objects.filter(task=task, type="draft.proposed").exists()
    else:  # the approval it waited for can no longer be given
        assert ApprovalRequest.objects.get(task=task).status == ApprovalStatus.INVALIDATED
