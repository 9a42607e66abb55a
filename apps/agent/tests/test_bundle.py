"""The pinned artifact bundle is honoured or refused (spec §16.11): a task runs with the prompt
template it was pinned to, and a task pinned to a prompt, parser, controller or tool schema this
build does not carry fails explicitly, before it proposes anything, and is never run with the code
the build has now."""

from __future__ import annotations

import pytest

from apps.agent.bundle import bundle_problem
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.events.models import RefusedEvent, TaskEvent
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
    ("tool_schemas", "x", "tool_schemas must map each tool to its schema version, not str"),
    ("tool_schemas", ["ticket.create"], "tool_schemas must map each tool to its schema version, not list"),
    ("reducer", "reducer/99", "reducer 'reducer/99' is not in this build"),
    ("model_provider", "bogus", "model_provider 'bogus' is not in this build (it has local, openai_compatible)"),
    ("response_format", "bogus", "response_format 'bogus' is not in this build (it has json_schema, json_object)"),
    ("response_format", ["json_object"], "response_format ['json_object'] is not in this build"),
    ("max_output_tokens", "abc", "max_output_tokens 'abc' is not a positive whole number"),
    ("max_output_tokens", 0, "max_output_tokens 0 is not a positive whole number"),
    ("units_per_1k_tokens", True, "units_per_1k_tokens True is not a price"),
    ("units_per_1k_tokens", "x", "units_per_1k_tokens 'x' is not a price"),
    ("embedding_model", "word2vec", "embedding_model 'word2vec' is not in this build"),
])
def test_each_part_the_build_does_not_carry_is_named(part, value, words):
    assert words in bundle_problem({**artifact_bundle_current(), part: value})


def test_an_openai_compatible_bundle_needs_its_model_and_address():
    bundle = {**artifact_bundle_current(), "model_provider": "openai_compatible", "model": "m",
              "model_base_url": "http://127.0.0.1:1", "response_format": "json_object"}
    assert bundle_problem(bundle) is None
    assert "model_base_url None" in bundle_problem({**bundle, "model_base_url": None})
    assert bundle_problem({**bundle, "embedding_model": "openai:http://127.0.0.1:2#e5"}) is None


def test_a_task_pinned_to_a_reducer_the_build_lacks_is_refused_once_and_left_as_it_was(requester, device, kb):
    """Not even ``task.failed`` can be reduced without the pinned reducer: the run records the
    refusal as a refused event (once, however often the task is claimed) and runs no step."""
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    Task.objects.filter(pk=task.pk).update(artifact_bundle={**task.artifact_bundle, "reducer": "reducer/99"})
    drive(task.pk)
    task = drive(task.pk)
    assert (task.status, task.version) == (reducer.ACCEPTED, 1)
    refused = RefusedEvent.objects.filter(task=task)
    assert [r.reason for r in refused] == [
        "bundle_unsupported: reducer 'reducer/99' is not in this build (it has "
        + ", ".join(reducer.REDUCERS) + ")"]


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
