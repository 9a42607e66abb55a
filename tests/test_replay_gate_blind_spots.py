"""The release gate (``manage.py replay_trajectories``; apps/agent/trajectories.py) never reports "no
divergence" for a change it did not exercise: a candidate output parser is run on the recorded
replies (malformed ones included), a task it cannot re-drive fails the gate, a reply recorded cut
is not re-parsed, every model part and the reducer of the candidate is either used or refused, and
a bad candidate is a clear error before any task is replayed."""

from __future__ import annotations

import json

import pytest

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.llm.drafter import rules_priority
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.test_trajectory_replay import _run
from tools.scripted_model_server import draft_from_prompt

pytestmark = pytest.mark.django_db(transaction=True)

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."




def _raw_line_break_replies(model_server) -> None:
    """Every reply: a valid draft whose description holds a raw line break inside the JSON string
    (model-output-parser/2 reads it, /1 refuses it)."""
    def next_step(body):
        model_server.requests.append({"messages": body.get("messages")})
        reply = draft_from_prompt(body["messages"])
        reply["description"] = "Reported: " + SYMPTOM + "@@NL@@The device is in fault."
        return {"content": json.dumps(reply).replace("@@NL@@", "\n")}
    model_server.next_step = next_step


def _submit(requester, device, **kw):
    return drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high",
                             **kw).task.pk)


@pytest.fixture
def proposed(requester, device, kb, refservice, model_server):
    """One task on the scripted model, waiting for approval (model suggested P4; the rules decide)."""
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4"}}])
    task = _submit(requester, device)
    assert task.status == reducer.WAITING_APPROVAL
    return task


# --- 1. the candidate's output parser is run on the recorded reply ---------------------------------

def test_a_candidate_parser_that_refuses_the_recorded_reply_diverges_instead_of_using_the_local_drafter(
        requester, device, kb, refservice, model_server):
    _raw_line_break_replies(model_server)
    task = _submit(requester, device)
    assert task.status == reducer.WAITING_APPROVAL and task.artifact_bundle["output_parser"] == "model-output-parser/2"
    reply_seq = TaskEvent.objects.get(task=task, type="model.called").seq

    code, out = _run("--bundle", "output_parser=model-output-parser/1")

    assert code == 1, out
    assert f"task {task.pk}: 1 decision point(s), DIVERGES" in out
    assert "termination 'proposal' -> 'malformed_reply'" in out
    assert f"model-output-parser/1 refuses the reply recorded at seq {reply_seq}: (root): not JSON" in out
    assert "local drafter" not in out
    # its own parser reads the reply: the same decisions
    code, out = _run("--bundle", "pinned")
    assert code == 0 and f"task {task.pk}: 1 decision point(s), same decisions" in out, out


# --- 2. malformed replies are decision points; a task the gate cannot check fails it ------------------

def test_a_task_that_gave_up_on_malformed_replies_diverges_under_a_parser_that_reads_them(
        requester, device, kb, refservice, model_server, monkeypatch):
    import apps.llm.providers as providers
    monkeypatch.setattr(providers, "OUTPUT_PARSER_VERSION", "model-output-parser/1")
    _raw_line_break_replies(model_server)
    task = _submit(requester, device)
    assert task.status == reducer.FAILED and task.termination_reason.startswith("model_output_invalid")
    malformed = list(TaskEvent.objects.filter(task=task, type="model.called", payload__outcome="malformed")
                     .order_by("seq").values_list("seq", flat=True))
    assert len(malformed) == 3  # the first call and MODEL_MAX_REASKS (2) re-asks

    code, out = _run("--bundle", "output_parser=model-output-parser/2")

    assert code == 1, out
    assert f"task {task.pk}: 3 decision point(s), DIVERGES" in out
    for seq in malformed:
        assert f"  seq {seq}: termination 'malformed_reply' -> 'proposal'" in out
    assert "diverged_points=3" in out and "termination=3" in out
    # its own parser refuses them as it did: three points, the same decisions
    code, out = _run("--bundle", "pinned")
    assert code == 0 and f"task {task.pk}: 3 decision point(s), same decisions" in out, out
    # live, the model is asked once, where the task gave up (its last malformed reply)
    code, out = _run("--bundle", "output_parser=model-output-parser/2", "--live")
    assert code == 1 and f"task {task.pk}: 1 decision point(s), DIVERGES" in out, out
    assert f"  seq {malformed[-1]}: termination 'malformed_reply' -> 'proposal'" in out


@pytest.mark.allow_divergence  # a task pinned to a reducer this build lacks cannot be replayed by the suite either
def test_a_task_pinned_to_a_reducer_this_build_lacks_is_not_replayable_and_fails_the_gate(proposed, device,
                                                                                            requester):
    from tests.factories import DeviceFactory
    other = _submit(requester, DeviceFactory(tenant=device.tenant, asset_tag="PRN-0998"))
    Task.objects.filter(pk=proposed.pk).update(artifact_bundle={**proposed.artifact_bundle, "reducer": "reducer/0"})

    code, out = _run("--bundle", "pinned")

    assert code == 1, out
    assert f"task {proposed.pk}: 0 decision point(s), NOT REPLAYABLE" in out
    assert "its pinned bundle cannot run in this build: reducer 'reducer/0' is not in this build" in out
    assert f"task {other.pk}: 1 decision point(s), same decisions" in out
    assert "not_replayable_tasks=1" in out and "could not be re-driven" in out


def test_tasks_without_a_decision_point_are_shown_and_counted_and_alone_check_nothing(proposed, requester, device,
                                                                                        model_server):
    from tests.factories import DeviceFactory
    model_server.set_script([{"status": 400}])
    failed = _submit(requester, DeviceFactory(tenant=device.tenant, asset_tag="PRN-0997"))
    assert failed.status == reducer.FAILED and failed.termination_reason.startswith("model_error")

    code, out = _run("--bundle", "pinned")

    assert code == 0, out
    assert f"task {failed.pk}: no decision point: it ended (task.failed: model_error" in out
    assert "tasks=2 decision_points=1" in out and "no_decision_point_tasks=1" in out
    code, out = _run("--bundle", "pinned", "--task", str(failed.pk))
    assert code == 1 and "no decision point was re-driven (1 task(s) selected): the gate checked nothing" in out


def test_purged_tasks_are_counted_apart_and_a_selection_of_only_purged_tasks_says_why_it_checked_nothing(
        proposed, requester, approver, device, model_server):
    from datetime import timedelta

    from django.utils import timezone

    from apps.actions.models import Action
    from apps.retention.purge import purge_run
    from tests.factories import DeviceFactory

    approval = ApprovalRequest.objects.get(task=proposed, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    done = drive(proposed.pk)
    assert done.status == reducer.COMPLETED
    long_ago = timezone.now() - timedelta(days=200)
    Task.objects.filter(pk=done.pk).update(updated_at=long_ago)
    Action.objects.filter(task=done).update(created_at=long_ago)
    assert purge_run().tasks["payload"] == 1

    code, out = _run("--bundle", "pinned")

    assert code == 1, out
    assert f"task {done.pk}: not checked: purged by retention (payload)" in out
    assert "tasks=1 decision_points=0" in out and "no_decision_point_tasks=0 purged_tasks=1" in out
    assert "all 1 task(s) selected were purged by retention (their recorded inputs are gone): " \
           "the gate checked nothing" in out
    # beside a task it can check, a purged one is named and counted, and does not fail the gate
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4"}}])
    fresh = _submit(requester, DeviceFactory(tenant=device.tenant, asset_tag="PRN-0996"))
    assert fresh.status == reducer.WAITING_APPROVAL
    code, out = _run("--bundle", "pinned")
    assert code == 0, out
    assert "tasks=2 decision_points=1" in out and "no_decision_point_tasks=0 purged_tasks=1" in out


# --- 3. a reply recorded cut is not re-parsed ------------------------------------------------------

@pytest.mark.allow_divergence  # the recorded reply is cut on purpose, as builds before the whole reply was kept did
@pytest.mark.parametrize("marker", [None, True], ids=["cut at the old cap, no marker", "marked output_truncated"])
def test_a_reply_recorded_cut_is_not_replayable_unless_asked_again_live(requester, device, kb, refservice,
                                                                        model_server, marker):
    long_description = ("Pages come out smeared with unfused toner after warm-up. " * 140)[:7900]
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4", "description": long_description}}])
    task = _submit(requester, device)
    call = TaskEvent.objects.get(task=task, type="model.called")
    assert len(call.payload["output"]) > 8000  # recorded whole
    assert call.payload["output_truncated"] is False  # this build records the marker
    # as a build before the whole reply was kept recorded it: cut at 8,000 characters, no marker
    cut = {k: v for k, v in call.payload.items() if k != "output_truncated"}
    cut["output"] = call.payload["output"][:8000]
    if marker:
        cut.update(output=call.payload["output"][:5000], output_truncated=True)
    TaskEvent.objects.filter(pk=call.pk).update(payload=cut)

    code, out = _run("--bundle", "controller=controller/1")

    assert code == 1, out
    assert f"task {task.pk}: 1 decision point(s), NOT REPLAYABLE" in out
    draft_seq = TaskEvent.objects.get(task=task, type="draft.proposed").seq
    assert f"seq {draft_seq}: not replayable: the recorded reply" in out
    assert f"at seq {call.seq}; it cannot be re-parsed faithfully (use --live)" in out
    assert "not_replayable_points=1" in out and "local drafter" not in out
    # asked again, the candidate is judged: controller/1 takes the model's P4 where the rules said P1
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4"}}])
    code, out = _run("--bundle", "controller=controller/1", "--live")
    assert code == 1 and "NOT REPLAYABLE" not in out
    assert f"priority {task.state['draft']['ticket']['priority']!r} -> 'P4'" in out


def test_a_long_reply_recorded_whole_is_re_parsed(requester, device, kb, refservice, model_server):
    long_description = ("Pages come out smeared with unfused toner after warm-up. " * 140)[:7900]
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4", "description": long_description}}])
    task = _submit(requester, device)
    code, out = _run("--bundle", "controller=controller/1")
    assert code == 1 and f"task {task.pk}: 1 decision point(s), DIVERGES" in out, out
    assert f"priority {task.state['draft']['ticket']['priority']!r} -> 'P4'" in out


# --- 4. every part of the candidate is used or refused ------------------------------------------------

def test_a_switch_to_the_local_drafter_re_derives_with_it_instead_of_reusing_the_model_reply(
        requester, device, kb, refservice, model_server, monkeypatch):
    import apps.tasks.services as services
    monkeypatch.setattr(services, "CONTROLLER_VERSION", "controller/1")  # the model's priority is taken
    model_server.set_script([{"reply": "draft", "overrides": {"priority": "P4"}}])
    task = _submit(requester, device)
    assert task.state["draft"]["ticket"]["priority"] == "P4"
    local = rules_priority(request=task.state["request"], device=task.state["device"])
    assert local != "P4"

    code, out = _run("--bundle", '{"model_provider": "local", "model": "local-drafter/2"}')

    assert code == 1, out
    assert f"seq {TaskEvent.objects.get(task=task, type='draft.proposed').seq}: priority 'P4' -> {local!r}" in out


@pytest.mark.parametrize("candidate, change", [
    ("model=some-other-model", "model 'scripted-model' -> 'some-other-model'"),
    ("model_base_url=http://127.0.0.1:9/v1", "model_base_url "),
    ("response_format=json_object", "response_format 'json_schema' -> 'json_object'"),
    ("max_output_tokens=77", "max_output_tokens 1200 -> 77"),
])
def test_a_model_change_without_live_is_not_judged_from_recorded_replies(proposed, candidate, change):
    code, out = _run("--bundle", candidate)
    assert code == 2, out
    assert f"not judged: the candidate changes the model ({change}" in out and "run again with --live" in out
    assert f"task {proposed.pk}" not in out  # refused before any task is replayed


def test_model_parts_equal_to_the_pinned_ones_are_no_change(proposed):
    code, out = _run("--bundle", "max_output_tokens=1200,model=scripted-model")
    assert code == 0 and f"task {proposed.pk}: 1 decision point(s), same decisions" in out, out


def test_a_new_model_asked_live_is_judged(proposed, settings):
    from tests.gateway import allow

    allow(settings, "model", "http://127.0.0.1:9")  # a candidate server is listed for the tool gateway
    code, out = _run("--bundle", "model_base_url=http://127.0.0.1:9/v1", "--live")
    assert code == 1 and "termination 'proposal' -> 'model_failed'" in out and "live model call: unavailable" in out


@pytest.fixture
def rejected(requester, approver, device, kb, refservice, model_server, monkeypatch):
    """A task whose first draft was rejected and whose re-worded re-draft (same action) was refused."""
    monkeypatch.setattr(reducer, "CURRENT", reducer.v5.VERSION)
    model_server.set_script([{"reply": "draft", "overrides": {"title": "Smeared pages after warm-up"}},
                             {"reply": "draft", "overrides": {"title": "Pages smeared: the fuser after warm-up"}}])
    task = _submit(requester, device)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="reject", reason="duplicate")
    task = drive(task.pk)
    assert task.termination_reason == "proposal_rejected" and task.artifact_bundle["reducer"] == "reducer/5"
    return task


def test_the_candidate_reducer_rebuilds_the_state_and_is_validated(rejected):
    # reducer/4 remembers a rejection by its digest only: the re-worded draft would have gone to the approver
    code, out = _run("--bundle", "reducer=reducer/4")
    assert code == 1, out
    assert f"task {rejected.pk}: 2 decision point(s), DIVERGES" in out
    assert "termination 'proposal_rejected' -> 'proposal'" in out
    # reducer/1 refuses the recorded ledger events: not replayable, not passed
    code, out = _run("--bundle", "reducer=reducer/1")
    assert code == 1 and f"task {rejected.pk}: 0 decision point(s), NOT REPLAYABLE" in out, out
    assert "reducer/1 refuses the recorded event seq" in out and "(budget.reserved): unknown event type" in out
    code, out = _run("--bundle", "reducer=reducer/99")
    assert code == 1 and "reducer 'reducer/99' is not in this build (it has reducer/1" in out
    assert f"task {rejected.pk}" not in out


# --- 5. a bad candidate is a clear error, before any task is replayed ----------------------------------

@pytest.mark.parametrize("args, code, message", [
    (["--bundle", '{"tool_schemas": "x"}'], 1, "tool_schemas must map each tool to its schema version, not str"),
    (["--bundle", '{"tool_schemas": ["ticket.create"]}'], 1, "tool_schemas must map each tool"),
    (["--bundle", "response_format=bogus", "--live"], 1,
     "response_format 'bogus' is not in this build (it has json_schema, json_object)"),
    (["--bundle", "max_output_tokens=abc", "--live"], 1, "max_output_tokens 'abc' is not a positive whole number"),
    (["--bundle", '{"units_per_1k_tokens": "x"}', "--live"], 1, "units_per_1k_tokens 'x' is not a price"),
    (["--bundle", "model_provider=bogus", "--live"], 1,
     "model_provider 'bogus' is not in this build (it has local, openai_compatible)"),
    (["--bundle", '{"controller": ["controller/2"]}'], 1, "controller ['controller/2'] is not in this build"),
    (["--bundle", '{"modle": "x"}'], 1, "unknown bundle part(s) 'modle' (the parts are model_provider, model"),
    (["--bundle", '{"model": 7}', "--live"], 1, "model 7 must be non-empty text"),
    (["--bundle", "embedding_model=all-MiniLM-L6-v2"], 2, "embedding_model"),
    (["--bundle", "pinned", "--task", "not-a-uuid"], 1, "--task 'not-a-uuid' is not a task id (a UUID)"),
    (["--bundle", "pinned", "--limit", "-1"], 1, "--limit -1 must be 0 (no limit) or more"),
    (["--bundle", "pinned", "--tenant", "no-such-tenant"], 1, "--tenant 'no-such-tenant': no such tenant"),
])
def test_a_bad_candidate_or_argument_is_a_clear_error_before_any_task_is_replayed(proposed, args, code, message):
    got, out = _run(*args)
    assert got == code, out
    assert message in out
    assert f"task {proposed.pk}" not in out and "Traceback" not in out


@pytest.mark.allow_divergence  # the recorded evidence is cut down on purpose
def test_a_recorded_state_the_code_cannot_read_is_not_replayable_never_a_traceback(requester, device, kb):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                             symptom="Fuser error after warm-up, pages come out smeared with unfused toner.").task.pk)
    assert task.artifact_bundle["model_provider"] == "local" and task.status == reducer.WAITING_APPROVAL
    retrieved = TaskEvent.objects.get(task=task, type="evidence.retrieved")
    refs = [{k: v for k, v in r.items() if k != "document_id"} for r in retrieved.payload["refs"]]
    TaskEvent.objects.filter(pk=retrieved.pk).update(payload={**retrieved.payload, "refs": refs})
    code, out = _run("--bundle", "pinned", "--task", str(task.pk))
    assert code == 1, out
    assert "not replayable: the recorded state cannot be re-driven: KeyError: 'document_id'" in out
