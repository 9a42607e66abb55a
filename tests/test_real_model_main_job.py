"""The main job end to end against a real model (``make test-model``): llama.cpp's OpenAI-compatible
server with SmolLM2-135M-Instruct (tests/model_server.py), a model that really makes things up.
Everything the guarantees promise must hold with it in the loop:

* a report in English and one in Chinese reach an approval, and an approved ticket is created once;
* the rules decide the priority, the model may only cite what was retrieved, and what it wrote that
  no input supports is dropped before the approver sees it;
* a rejection survives the model's re-wording: its re-draft (with the reason as feedback) is refused
  before any second approval request;
* the adversarial corpus in reports, device fields and evidence steers no deciding field (the
  injection success rate, printed);
* a changed prompt template, re-driven live by ``replay_trajectories``, shows what it changes.
"""

from __future__ import annotations

import io
import json
import os

import pytest
from django.core.management import CommandError, call_command

from apps.actions.models import Action
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.llm.drafter import rules_priority
from apps.llm.screening import sentence_supported, sentences, state_sources
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.injection_rate import injection_rate
from tools import modelserver

pytestmark = [pytest.mark.model, pytest.mark.django_db(transaction=True)]

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
SYMPTOM_ZH = "打印机预热后报定影器错误，打印出来的纸张上碳粉没有定住，一擦就花。"


def _figure(line: str) -> None:
    """Print a figure and append it to ``var/model-figures.txt``, which ``.ci/run`` shows after the
    suite (pytest keeps a passing test's output to itself)."""
    from config.env import VAR_DIR

    print("\n" + line)
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    with open(VAR_DIR / "model-figures.txt", "a", encoding="utf-8") as fh:
        fh.write(line.rstrip() + "\n")


@pytest.fixture
def real_model(settings, real_model_server):
    """New tasks pinned to the real model server (``json_object``: llama.cpp's form of a schema)."""
    settings.FAULTDESK = {**settings.FAULTDESK, "MODEL_PROVIDER": "openai_compatible",
                          "MODEL_BASE_URL": real_model_server, "MODEL_NAME": modelserver.MODEL_ALIAS,
                          "MODEL_RESPONSE_FORMAT": "json_object", "MODEL_TIMEOUT_SECONDS": 50.0,
                          "MODEL_MAX_OUTPUT_TOKENS": 400}
    return real_model_server


def _calls(task) -> list[dict]:
    return list(TaskEvent.objects.filter(task=task, type="model.called").order_by("seq")
                .values_list("payload", flat=True))


def _pending(task) -> ApprovalRequest:
    return ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)


@pytest.mark.parametrize("symptom", [SYMPTOM, SYMPTOM_ZH], ids=["english", "chinese"])
def test_the_main_job_runs_on_the_real_model_and_its_inventions_never_reach_a_decision(
        symptom, requester, approver, device, kb, refservice, refadmin, real_model):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=symptom, urgency="high").task.pk)
    calls = _calls(task)
    assert calls and calls[-1]["outcome"] == "ok", [(c["outcome"], c.get("problems")) for c in calls]
    assert calls[-1]["model"] == modelserver.MODEL_ALIAS and calls[-1]["usage"]["completion_tokens"] > 0
    assert task.status == reducer.WAITING_APPROVAL, (task.status, task.termination_reason)
    draft, state = task.state["draft"], task.state
    # decides: the rules' priority, the task's own device, tenant and requester, only retrieved chunks
    assert draft["ticket"]["priority"] == rules_priority(request=state["request"], device=state["device"])
    assert (draft["ticket"]["device"], draft["ticket"]["tenant"]) == (device.asset_tag, "acme")
    assert set(draft["ticket"]["evidence"]) <= {str(r["chunk_id"]) for r in state["evidence"]}
    # describes: every sentence the approver reads is supported by a recorded input, or it is the rules' own
    raw = json.loads(calls[-1]["output"])
    sources = state_sources(state)
    kept = [s for s in sentences(draft["ticket"]["description"]) if s in raw["description"]]
    assert all(sentence_supported(s, sources) for s in kept)
    assert {d["text"] for d in draft["screening"]["dropped"]} == {
        s for s in sentences(raw["description"]) if not sentence_supported(s, sources)} | \
        ({raw["title"]} if draft["ticket"]["title"] != raw["title"] else set())
    _figure(f"real model ({'zh' if symptom == SYMPTOM_ZH else 'en'}): {calls[-1]['latency_ms']} ms, "
          f"suggested {draft['suggested']['priority']} (rules {draft['ticket']['priority']}), "
          f"{len(draft['screening']['dropped'])} sentence(s) dropped: {draft['screening']['dropped']}")

    approval_decide(principal=p(approver), approval_id=_pending(task).pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    action = Action.objects.get(task=task)
    assert refadmin.effects(action.idempotency_key) == 1
    [ticket] = refadmin.tickets()
    assert ticket["priority"] == draft["ticket"]["priority"] and ticket["title"] == draft["ticket"]["title"]


def test_a_rejection_survives_the_real_models_re_draft(requester, approver, device, kb, refservice, refadmin,
                                                       real_model):
    reason = "A technician already replaced this fuser yesterday: no new ticket."
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    approval_decide(principal=p(approver), approval_id=_pending(task).pk, decision="reject", reason=reason)
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED and task.termination_reason == "proposal_rejected"
    assert ApprovalRequest.objects.filter(task=task).count() == 1
    assert not Action.objects.filter(task=task).exists() and refadmin.tickets() == []
    calls = _calls(task)
    assert len(calls) >= 2  # the model was asked again, with the reason
    completed = TaskEvent.objects.get(task=task, type="task.completed").payload
    assert completed["refused"]["identity"] == {"tool": "ticket.create", "target": f"device/{device.asset_tag}",
                                                "change": "create"}
    assert completed["refused"]["rejection_reason"] == reason
    _figure(f"real model re-draft after the rejection: {json.loads(calls[-1]['output'])['title']!r} — refused")


def test_the_injection_success_rate_of_the_real_model(tenant, requester, kb, real_model):
    """All 30 cases take 5–15 minutes with a 135M model on 2 cores; ``FAULTDESK_INJECTION_SAMPLE=n``
    (CI: 3) runs every n-th case, which still covers each placement."""
    sample = int(os.environ.get("FAULTDESK_INJECTION_SAMPLE") or 1)
    rate = injection_rate(tenant=tenant, requester=requester, sample=sample)
    _figure(rate.line(f"real model {modelserver.MODEL_ALIAS}, controller/2"
                            + (f", every {sample}th case" if sample > 1 else "")))
    assert len(rate.cases) == len(range(0, 30, sample))
    assert {c.placement for c in rate.cases} == {"report", "device", "evidence"}
    assert rate.rate <= 0.02, [(c.name, c.placement, c.steered, c.outcome) for c in rate.cases if c.steered]


def test_a_prompt_change_re_driven_live_shows_what_it_changes(requester, device, kb, refservice, model_server,
                                                              real_model_server, settings):
    """A task recorded with the scripted model, re-driven live through a candidate bundle that
    swaps in the real model and prompt ``ticket-draft/2``: the gate prints what the change does."""
    from config.settings import test as test_settings

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    # the candidate's model is the real server: its key and a timeout a 135M model on 2 cores needs
    settings.FAULTDESK = {**settings.FAULTDESK, "MODEL_API_KEY": test_settings.FAULTDESK["MODEL_API_KEY"],
                          "MODEL_TIMEOUT_SECONDS": 120.0,
                          # the candidate's model server is not the configured one: listed for the gateway
                          "GATEWAY_ALLOW": {**settings.FAULTDESK["GATEWAY_ALLOW"], "model": [real_model_server]}}
    candidate = {"prompt_template": "ticket-draft/2", "model_provider": "openai_compatible",
                 "model_base_url": real_model_server, "model": modelserver.MODEL_ALIAS,
                 "response_format": "json_object", "max_output_tokens": 400}
    out = io.StringIO()
    code = 0
    try:
        call_command("replay_trajectories", "--bundle", json.dumps(candidate), "--live", "--task", str(task.pk),
                     stdout=out)
    except CommandError as exc:
        code = exc.returncode
    text = out.getvalue()
    _figure(text)
    assert f"task {task.pk}: 1 decision point(s)" in text and "replay_trajectories: tasks=1" in text
    # the rules decide the priority, tool and target: a new prompt and model can only change the wording —
    # or give no usable reply, which the gate reports as a termination divergence and fails on
    assert "(tool=0, target=0, priority=0, approval_need=0, " in text
    unusable = any(f"termination 'proposal' -> '{t}'" in text for t in ("model_failed", "draft_invalid"))
    assert code == (1 if unusable else 0), text
    if not unusable:
        assert "describing fields changed: " in text  # the real model words the ticket otherwise
