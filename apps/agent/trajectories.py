"""Trajectory replay as a release gate (spec §16.11 "轨迹回放", "发布固定整个制品包"): re-drive the
recorded inputs of finished and running tasks through a *candidate* artifact bundle — another
controller, prompt template or model — and report where its decisions would diverge from what the
task recorded, before the bundle is released.

Replay of the record (apps/tasks/replay.py) re-runs the reducer over the events and proves the state
follows from them. This module asks the other question: *would the new bundle decide the same?* At
every decision point of a task — each ``draft.proposed``, and each re-draft refused as a rejected
action (``task.completed`` ``proposal_rejected`` with ``refused``) — it rebuilds the state just
before it with the task's pinned reducer, takes the model's recorded reply there (the last
``model.called`` with outcome ``ok``; the local drafter is re-run, it is deterministic) or, with
``live``, asks the candidate's model again with the candidate's prompt, and runs the candidate's
controller over it: the draft (:func:`apps.agent.drafting.draft_from_output`), the business rules
(:func:`apps.llm.parser.draft_validate`), the rejection constraint, the plan
(:func:`apps.agent.drafting.plan`) and the tenant's approval policy.

Decision fields (a divergence in any fails the gate): ``tool``, ``target``, ``priority``,
``approval_need``, ``termination`` (``proposal``, ``input_requested``, ``draft_invalid``,
``proposal_rejected``, ``model_failed``). Describing fields (``title``, ``description``,
``evidence``) are reported as changes, never as failures: the model may word things differently.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from django.conf import settings

from apps.actions.digest import action_identity
from apps.agent.bundle import bundle_problem
from apps.agent.controllers import CONTROLLERS, controller_for
from apps.agent.drafting import draft_from_output, plan, rejection_covering
from apps.approvals.policy import policy_decide
from apps.events.models import TaskEvent
from apps.llm.drafter import PROMPT_TEMPLATE_VERSION, local_draft, render_prompt
from apps.llm.parser import draft_validate
from apps.llm.providers import model_output_parse, output_schema_for, provider_for
from apps.tasks import reducer
from apps.tasks.models import Task

DECISION_FIELDS = ("tool", "target", "priority", "approval_need", "termination")
DESCRIBING_FIELDS = ("title", "description", "evidence")

#: the event after a draft that shows what the controller decided, and the termination it means
_OUTCOMES = {"draft.invalid": "draft_invalid", "input.requested": "input_requested",
             "approval.requested": "proposal", "intent.committed": "proposal"}


#: events after a draft that end its decision point before the controller's outcome: what follows
#: belongs to another draft (one ticket per fault deferred it, a cancel, a re-plan, a failure)
_ENDS_POINT = frozenset({"draft.proposed", "intent.deferred", "approval.invalidated", "dispatch.conflict",
                         "task.failed", "task.cancelled", "cancel.requested", "input.provided",
                         "evidence.retrieved", "device.read", "ticket.read"})


class BundleInvalid(ValueError):
    """A candidate bundle this build cannot run (a part it does not carry), or a malformed one."""


@dataclass
class Point:
    """One decision point of a task: the ``seq`` of its event, what was ``recorded`` and what the
    candidate decides (``candidate``), each ``{field: value}`` over :data:`DECISION_FIELDS` and
    :data:`DESCRIBING_FIELDS` (None where the record does not say); ``note`` explains a point
    whose model input had to be stood in for."""

    seq: int
    recorded: dict
    candidate: dict
    note: str = ""

    @property
    def divergences(self) -> list[tuple[str, object, object]]:
        """``(field, recorded, candidate)`` for each decision field both sides know and differ on."""
        return [(f, self.recorded.get(f), self.candidate.get(f)) for f in DECISION_FIELDS
                if self.recorded.get(f) is not None and self.candidate.get(f) is not None
                and self.recorded.get(f) != self.candidate.get(f)]

    @property
    def changes(self) -> list[str]:
        """The describing fields whose value differs."""
        return [f for f in DESCRIBING_FIELDS if self.recorded.get(f) is not None
                and self.candidate.get(f) is not None and self.recorded.get(f) != self.candidate.get(f)]


@dataclass
class TaskReplay:
    """A task's decision points under the candidate bundle; ``skipped`` says why none were re-driven."""

    task_id: str
    points: list[Point] = field(default_factory=list)
    skipped: str = ""


def candidate_bundle(base: dict, overrides: dict) -> dict:
    """``base`` (a task's pinned bundle) with ``overrides`` (e.g. ``{"prompt_template":
    "ticket-draft/2"}``) applied. Raises :class:`BundleInvalid` when this build cannot run it."""
    bundle = {**base, **overrides}
    if problem := bundle_problem(bundle):
        raise BundleInvalid(problem)
    if bundle.get("controller", "controller/1") not in CONTROLLERS:
        raise BundleInvalid(f"controller {bundle.get('controller')!r} is not in this build")
    return bundle


def _recorded(events: list, i: int) -> dict:
    etype, payload = events[i].type, events[i].payload
    if etype == "task.completed":  # a re-draft refused as a rejected action
        identity = (payload.get("refused") or {}).get("identity") or {}
        return {"termination": "proposal_rejected", "tool": identity.get("tool"), "target": identity.get("target"),
                "title": (payload.get("refused") or {}).get("title")}
    ticket = (payload.get("draft") or {}).get("ticket") or {}
    out = {"priority": ticket.get("priority"), "title": ticket.get("title"), "description": ticket.get("description"),
           "evidence": ticket.get("evidence")}
    for later in events[i + 1:]:
        if later.type in _OUTCOMES:
            out["termination"] = _OUTCOMES[later.type]
            proposal = later.payload.get("proposal")
            if proposal:
                identity = action_identity(tool=proposal["tool"], params=proposal["params"])
                out.update(tool=identity["tool"], target=identity["target"])
            out["approval_need"] = {"approval.requested": True,
                                    "intent.committed": False if later.payload.get("approval_required") is False
                                    else None}.get(later.type)
            break
        if later.type in _ENDS_POINT:
            break  # the draft led nowhere the controller decided (a deferral, a cancel, a re-plan, a failure)
    return out


def _model_output(events: list, i: int, since: int, parser: str) -> tuple[dict | None, str | None]:
    """The reply of the last ``model.called`` with outcome ok in ``events[since:i]``, parsed by the
    candidate's output ``parser`` (and its prompt template), or ``(None, None)``."""
    for e in reversed(events[since:i]):
        if e.type == "model.called" and e.payload.get("outcome") == "ok" and e.payload.get("output"):
            output, _ = model_output_parse(e.payload["output"], parser)
            return output, e.payload.get("prompt_template")
    return None, None


def _decide(task: Task, state: dict, bundle: dict, output: dict | None, recorded_draft: dict | None) -> dict:
    """What the candidate ``bundle``'s controller decides at ``state`` from the model's ``output``
    (None: the local drafter)."""
    controller = controller_for(bundle)
    tenant, requester = task.tenant.slug, task.requester.get_username()
    if output is None:
        draft = local_draft(request=state["request"], device=state["device"], evidence=state["evidence"] or [],
                            tenant=tenant, requester=requester, answers=state.get("answers") or [],
                            selection=state.get("selection"))
    else:
        draft = draft_from_output(state=state, output=output, model=bundle.get("model", ""), tenant=tenant,
                                  requester=requester, controller=controller)
    ticket = draft["ticket"]
    # the due date is the policy's, kept per priority (reducer/4): the recorded one when it matches
    recorded_ticket = (recorded_draft or {}).get("ticket") or {}
    kept = (state.get("ticket_due") or {}).get(ticket["priority"])
    if not kept and recorded_ticket.get("priority") == ticket["priority"]:
        kept = recorded_ticket.get("due_at")
    if kept:
        ticket["due_at"] = kept
    out = {"priority": ticket["priority"], "title": ticket["title"], "description": ticket["description"],
           "evidence": ticket["evidence"]}
    proposal = plan(state, draft)
    identity = action_identity(tool=proposal["tool"], params=proposal["params"])
    out.update(tool=identity["tool"], target=identity["target"])
    if rejection_covering(state, proposal, controller) is not None:
        return {**out, "termination": "proposal_rejected"}
    problems = draft_validate(draft=draft, evidence_ids={str(r["chunk_id"]) for r in state["evidence"] or []},
                              device_asset_tag=state["device"]["asset_tag"], tenant=tenant)
    if problems:
        return {**out, "termination": "draft_invalid"}
    if draft["missing_information"]:
        return {**out, "termination": "input_requested"}
    selection = state.get("selection") or {}
    decision = policy_decide(tenant_id=task.tenant_id, tool=proposal["tool"], evidence=state["evidence"] or [],
                             no_procedure=selection.get("reason", "") if selection.get("outcome") == "no_procedure"
                             else "")
    return {**out, "termination": "proposal", "approval_need": decision.requires_approval}


def _live_output(state: dict, bundle: dict) -> tuple[dict | None, str]:
    """Ask the candidate's model at ``state`` with the candidate's prompt: ``(output, outcome)``."""
    provider = provider_for(bundle, settings.FAULTDESK)
    if provider is None:
        return None, "local"
    messages = render_prompt(request=state["request"], device=state["device"], evidence=state["evidence"] or [],
                             answers=state.get("answers") or [],
                             feedback=((state.get("model") or {}).get("feedback") or ()),
                             template=bundle.get("prompt_template", PROMPT_TEMPLATE_VERSION))
    schema = output_schema_for([str(r["chunk_id"]) for r in state["evidence"] or []]) \
        if controller_for(bundle).rules_decide else None
    result = provider.complete(messages, timeout=settings.FAULTDESK["MODEL_TIMEOUT_SECONDS"], schema=schema)
    return (result.output if result.outcome == "ok" else None), result.outcome


def trajectory_replay(task: Task, overrides: dict, *, live: bool = False) -> TaskReplay:
    """Re-drive ``task``'s decision points through its pinned bundle with ``overrides`` applied
    (:func:`candidate_bundle`; raises :class:`BundleInvalid`). ``live``: ask the candidate's model
    again (one call per decision point) instead of using the recorded replies."""
    pinned = task.artifact_bundle or {}
    bundle = candidate_bundle(pinned, overrides)
    events = list(TaskEvent.objects.filter(task_id=task.pk).order_by("seq").only("seq", "type", "payload"))
    result = TaskReplay(task_id=str(task.pk))
    try:
        reduce = reducer.reducer_for(pinned.get("reducer"))
    except reducer.UnknownReducer as exc:
        result.skipped = str(exc)
        return result
    state, since = reducer.initial_state(), 0
    for i, event in enumerate(events):
        refused = event.type == "task.completed" and event.payload.get("reason") == "proposal_rejected" \
            and event.payload.get("refused")
        if event.type == "draft.proposed" or refused:
            note = ""
            if live:
                output, outcome = _live_output(state, bundle)
                if output is None and outcome != "local":
                    result.points.append(Point(event.seq, _recorded(events, i), {"termination": "model_failed"},
                                               note=f"live model call: {outcome}"))
                    state, since = reduce(state, event.type, event.payload), i + 1
                    continue
            else:
                output, template = _model_output(events, i, since,
                                                 bundle.get("output_parser", "model-output-parser/1"))
                if pinned.get("model_provider", "local") != "local" and output is None:
                    note = "no recorded model reply: re-derived with the local drafter"
                if output is not None and template and template != bundle.get("prompt_template", template):
                    note = (f"model reply recorded under {template}; the candidate renders "
                            f"{bundle['prompt_template']} (use --live to ask the model again)")
            recorded_draft = event.payload.get("draft") if event.type == "draft.proposed" else None
            candidate = _decide(task, state, bundle, output, recorded_draft)
            result.points.append(Point(event.seq, _recorded(events, i), candidate, note=note))
            since = i + 1
        state = reduce(state, event.type, event.payload)
    if not result.points:
        result.skipped = "no decision point (no draft was made)"
    return result


@dataclass
class Totals:
    """Totals over a run: tasks, decision points, tasks and points with a decision divergence,
    divergences per field, describing changes per field, and live model calls' latencies (ms)."""

    tasks: int = 0
    points: int = 0
    diverged_tasks: int = 0
    diverged_points: int = 0
    by_field: Counter = field(default_factory=Counter)
    changes: Counter = field(default_factory=Counter)
    seconds: float = 0.0


def trajectories_replay(tasks, overrides: dict, *, live: bool = False, out=None) -> Totals:
    """Re-drive every task of ``tasks`` (an iterable of :class:`Task`) and write a per-task report
    to ``out`` (a text stream; None: nothing written). Returns the :class:`Totals`."""
    totals, started = Totals(), time.monotonic()

    def say(line: str) -> None:
        if out is not None:
            out.write(line + "\n")

    for task in tasks:
        replay = trajectory_replay(task, overrides, live=live)
        totals.tasks += 1
        if replay.skipped:
            say(f"task {replay.task_id}: skipped — {replay.skipped}")
            continue
        diverged = [p for p in replay.points if p.divergences]
        totals.points += len(replay.points)
        totals.diverged_points += len(diverged)
        totals.diverged_tasks += bool(diverged)
        for p in replay.points:
            totals.by_field.update(f for f, _, _ in p.divergences)
            totals.changes.update(p.changes)
        status = "DIVERGES" if diverged else "same decisions"
        say(f"task {replay.task_id}: {len(replay.points)} decision point(s), {status}")
        for p in replay.points:
            parts = [f"{f} {a!r} -> {b!r}" for f, a, b in p.divergences]
            if p.changes:
                parts.append("describing fields changed: " + ", ".join(p.changes))
            if parts or p.note:
                say(f"  seq {p.seq}: " + ("; ".join(parts) or "no change") + (f"  ({p.note})" if p.note else ""))
    totals.seconds = time.monotonic() - started
    return totals
