"""Trajectory replay as a release gate (spec §16.11 "轨迹回放", "发布固定整个制品包"): re-drive the
recorded inputs of finished and running tasks through a *candidate* artifact bundle — another
controller, prompt template, output parser, reducer or model — and report where its decisions would
diverge from what the task recorded, before the bundle is released.

Replay of the record (apps/tasks/replay.py) re-runs the reducer over the events and proves the state
follows from them. This module asks the other question: *would the new bundle decide the same?* What a
candidate may be and whether the recorded inputs can judge it is :mod:`apps.agent.trajectory_candidate`.

Decision points of a task:

* each ``draft.proposed``, and each re-draft refused as a rejected action (``task.completed``
  ``proposal_rejected`` with ``refused``);
* each model reply recorded as malformed (``model.called`` with outcome ``malformed``): the pinned
  run re-asked (or gave up, ``model_output_invalid``) there, and a candidate whose output parser
  reads the reply would have drafted instead. With ``live``, only a malformed reply after which the
  task got no usable reply at all is a point (the live model is asked there).

At each point the state just before it is rebuilt with the candidate's reducer (the task's pinned
one unless the candidate names another; a reducer that refuses a recorded event makes the task not
replayable from there). The model's input is then:

* the local drafter (deterministic) when the candidate drafts locally — its ``model_provider`` is
  ``local``, or its reducer keeps no ledger (``reducer/1``, ``/2`` draft locally whatever the
  provider);
* with ``live``, a new call to the candidate's model with the candidate's prompt;
* otherwise the recorded reply (the last ``model.called`` with outcome ``ok`` before the draft, or the
  malformed reply itself) parsed by the candidate's output parser. A reply the candidate's parser
  refuses is the termination ``malformed_reply``, a divergence — never a silent fallback to the
  local drafter. A point whose reply was not recorded, or recorded cut (``output_truncated``, or
  exactly :data:`LEGACY_OUTPUT_CAP` characters from builds that cut it there), is *not replayable*.

Then the candidate's controller runs over it: the draft (:func:`apps.agent.drafting.draft_from_output`),
the business rules (:func:`apps.llm.parser.draft_validate`), the rejection constraint, the plan
(:func:`apps.agent.drafting.plan`) and the tenant's approval policy.

Decision fields (a divergence in any fails the gate): ``tool``, ``target``, ``priority``,
``approval_need``, ``termination`` (``proposal``, ``input_requested``, ``draft_invalid``,
``proposal_rejected``, ``malformed_reply``: a reply the output parser refuses, ``model_failed``: a
live call that gave no usable reply where the record has a draft). Describing fields (``title``,
``description``, ``evidence``) are reported as changes, never as failures: the model may word
things differently.

What the recorded replies cannot judge is refused before any task is replayed
(:func:`candidate_judgeable`): a candidate that changes the model (:data:`MODEL_PARTS`) needs
``live`` — except a switch to the local drafter, which is run — and a new ``embedding_model`` is
never exercised (replay re-uses the recorded retrieval).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from django.conf import settings

from apps.actions.digest import action_identity
from apps.agent.controllers import controller_for
from apps.agent.drafting import draft_from_output, plan, rejection_covering
from apps.agent.trajectory_candidate import (  # noqa: F401 - re-exported: the gate's command and tests import them here
    BUNDLE_PARTS,
    DEFAULT_OUTPUT_PARSER,
    MODEL_PARTS,
    BundleInvalid,
    NotJudgeable,
    candidate_bundle,
    candidate_check,
    candidate_judgeable,
    drafts_locally,
    model_changes,
    pinned_problem,
)
from apps.approvals.policy import policy_decide
from apps.events.models import TaskEvent
from apps.llm.drafter import PROMPT_TEMPLATE_VERSION, local_draft, render_prompt
from apps.llm.parser import draft_validate
from apps.llm.providers import model_output_parse, output_schema_for, provider_for
from apps.tasks import reducer
from apps.tasks.models import Task

DECISION_FIELDS = ("tool", "target", "priority", "approval_need", "termination")
DESCRIBING_FIELDS = ("title", "description", "evidence")

#: builds before the whole reply was recorded cut ``model.called``'s ``output`` at this many characters
LEGACY_OUTPUT_CAP = 8000

#: the event after a draft that shows what the controller decided, and the termination it means
_OUTCOMES = {"draft.invalid": "draft_invalid", "input.requested": "input_requested",
             "approval.requested": "proposal", "intent.committed": "proposal"}

#: what the record says when the model's reply was refused as malformed (re-asked, or the task gave up)
MALFORMED = "malformed_reply"


#: events after a draft that end its decision point before the controller's outcome: what follows
#: belongs to another draft (one ticket per fault deferred it, a cancel, a re-plan, a failure)
_ENDS_POINT = frozenset({"draft.proposed", "intent.deferred", "approval.invalidated", "dispatch.conflict",
                         "task.failed", "task.cancelled", "cancel.requested", "input.provided",
                         "evidence.retrieved", "device.read", "ticket.read"})


@dataclass
class Point:
    """One decision point of a task: the ``seq`` of its event, what was ``recorded`` and what the
    candidate decides (``candidate``), each ``{field: value}`` over :data:`DECISION_FIELDS` and
    :data:`DESCRIBING_FIELDS` (None where the record does not say); ``note`` explains a point
    whose model input had to be stood in for; ``unreplayable`` says why the point could not be
    re-driven (then ``candidate`` is empty and the point neither passes nor diverges)."""

    seq: int
    recorded: dict
    candidate: dict
    note: str = ""
    unreplayable: str = ""

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
    """A task's decision points under the candidate bundle. ``unreplayable`` says why the task (or
    its rest, after the points listed) could not be re-driven — a gate that could not check it has
    not passed it; ``skipped`` says why it has no decision point at all (it ended, or stands, before
    any model reply or draft, or retention purged its inputs); ``purged`` is the task's retention
    level (``excerpts``, ``payload``) when that is why."""

    task_id: str
    points: list[Point] = field(default_factory=list)
    skipped: str = ""
    unreplayable: str = ""
    purged: str = ""

    @property
    def unreplayable_points(self) -> list[Point]:
        """The points that could not be re-driven."""
        return [p for p in self.points if p.unreplayable]


def _recorded(events: list, i: int) -> dict:
    etype, payload = events[i].type, events[i].payload
    if etype == "model.called":  # a reply refused as malformed: the run re-asked, or gave up
        return {"termination": MALFORMED}
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


def _cut(payload: dict) -> str:
    """Why a recorded reply is not the whole reply ('' when it is): marked ``output_truncated``, or
    exactly :data:`LEGACY_OUTPUT_CAP` characters with no marker (older builds cut it there)."""
    output = payload.get("output") or ""
    if payload.get("output_truncated"):
        return f"the recorded reply was cut at {len(output)} characters"
    if "output_truncated" not in payload and len(output) == LEGACY_OUTPUT_CAP:
        return (f"the recorded reply is {LEGACY_OUTPUT_CAP} characters, the cap older builds cut replies at: "
                "it may be cut")
    return ""


def _last_reply(events: list, i: int, since: int):
    """The last ``model.called`` with outcome ok in ``events[since:i]``, or None."""
    for e in reversed(events[since:i]):
        if e.type == "model.called" and e.payload.get("outcome") == "ok":
            return e
    return None


def _gave_up_after(events: list, i: int) -> bool:
    """Is the malformed reply at ``i`` the task's last reply before it gave up (it failed, was
    cancelled, or stands without a usable reply)? Under ``live`` that is where the model is asked
    again; where a later reply or draft follows, the live model is asked there instead."""
    for later in events[i + 1:]:
        if later.type in ("draft.proposed", "task.completed") or (
                later.type == "model.called" and later.payload.get("outcome") in ("ok", "malformed")):
            return False
        if later.type in ("task.failed", "task.cancelled"):
            return True
    return True


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


def _live_output(state: dict, bundle: dict):
    """Ask the candidate's model at ``state`` with the candidate's prompt: the provider's
    :class:`~apps.llm.providers.CallResult` (its ``output`` parsed by the candidate's output parser)."""
    provider = provider_for(bundle, settings.FAULTDESK)
    messages = render_prompt(request=state["request"], device=state["device"], evidence=state["evidence"] or [],
                             answers=state.get("answers") or [],
                             feedback=((state.get("model") or {}).get("feedback") or ()),
                             template=bundle.get("prompt_template", PROMPT_TEMPLATE_VERSION))
    schema = output_schema_for([str(r["chunk_id"]) for r in state["evidence"] or []]) \
        if controller_for(bundle).rules_decide else None
    return provider.complete(messages, timeout=settings.FAULTDESK["MODEL_TIMEOUT_SECONDS"], schema=schema)


def _point(task: Task, events: list, i: int, since: int, state: dict, pinned: dict, bundle: dict,
           live: bool) -> Point:
    """The decision point at ``events[i]`` (a draft, a refused re-draft or a malformed reply)
    re-driven through ``bundle`` at ``state``."""
    event = events[i]
    recorded = _recorded(events, i)
    recorded_draft = event.payload.get("draft") if event.type == "draft.proposed" else None
    if drafts_locally(bundle):
        return Point(event.seq, recorded, _decide(task, state, bundle, None, recorded_draft))
    if live:
        result = _live_output(state, bundle)
        if result.outcome == "ok":
            return Point(event.seq, recorded, _decide(task, state, bundle, result.output, recorded_draft))
        detail = "; ".join(result.problems[:2]) or result.error or ""
        # where the record has a malformed reply, another malformed one is the same decision
        term = MALFORMED if result.outcome == "malformed" and event.type == "model.called" else "model_failed"
        return Point(event.seq, recorded, {"termination": term},
                     note=f"live model call: {result.outcome}" + (f" ({detail[:200]})" if detail else ""))
    reply = event if event.type == "model.called" else _last_reply(events, i, since)
    if reply is None or (event.type != "model.called" and not reply.payload.get("output")):
        return Point(event.seq, recorded, {}, unreplayable="no model reply recorded for this draft (use --live)")
    if cut := _cut(reply.payload):
        return Point(event.seq, recorded, {}, unreplayable=f"{cut} at seq {reply.seq}; it cannot be re-parsed "
                                                           "faithfully (use --live)")
    parser = bundle.get("output_parser", DEFAULT_OUTPUT_PARSER)
    text = reply.payload.get("output")
    if event.type == "model.called":
        # refused for a reason of its own (the model refused, was cut off at max_tokens, the body was no
        # chat completion) when the pinned parser reads it: no output parser would have drafted from it
        pinned_read, _ = model_output_parse(text, pinned.get("output_parser", DEFAULT_OUTPUT_PARSER))
        if text is None or pinned_read is not None:
            return Point(event.seq, recorded, {"termination": MALFORMED})
    output, problems = model_output_parse(text, parser)
    if output is None:
        return Point(event.seq, recorded, {"termination": MALFORMED},
                     note=f"{parser} refuses the reply recorded at seq {reply.seq}: {'; '.join(problems[:2])}"[:300])
    note = ""
    template = reply.payload.get("prompt_template")
    if template and template != bundle.get("prompt_template", template):
        note = (f"model reply recorded under {template}; the candidate renders "
                f"{bundle['prompt_template']} (use --live to ask the model again)")
    return Point(event.seq, recorded, _decide(task, state, bundle, output, recorded_draft), note=note)


def _no_point_reason(task: Task, events: list) -> str:
    """Why a task has no decision point: how it ended (or stands) before any model reply or draft."""
    last = events[-1] if events else None
    if last is not None and last.type in ("task.failed", "task.completed", "task.cancelled"):
        reason = (last.payload or {}).get("reason") or last.type
        return f"no decision point: it ended ({last.type}: {str(reason)[:160]}) before any draft or model reply"
    return f"no decision point yet: {task.status}, no draft or model reply recorded"


def trajectory_replay(task: Task, overrides: dict, *, live: bool = False) -> TaskReplay:
    """Re-drive ``task``'s decision points through its pinned bundle with ``overrides`` applied
    (:func:`candidate_bundle`; raises :class:`BundleInvalid`). ``live``: ask the candidate's model
    again (one call per decision point) instead of using the recorded replies.

    A task its own bundle cannot run in this build (a part the candidate does not replace), whose
    reducer refuses one of its events, or whose model change only ``live`` can judge, is returned
    with ``unreplayable`` set (and the points before, if any); one without any decision point with
    ``skipped`` set, and one retention purged (``apps.tasks.retention``) with ``skipped`` and
    ``purged`` set: its recorded inputs are gone, nothing of it can be re-driven."""
    pinned = task.artifact_bundle or {}
    result = TaskReplay(task_id=str(task.pk))
    if getattr(task, "purged", ""):
        # retention took the recorded inputs (apps.tasks.retention): nothing is left to re-drive
        result.skipped = f"purged by retention ({task.purged}): its recorded inputs are gone"
        result.purged = task.purged
        return result
    if problem := pinned_problem(pinned, overrides):
        result.unreplayable = f"its pinned bundle cannot run in this build: {problem}"
        return result
    bundle = candidate_bundle(pinned, overrides)
    if not live and (changed := model_changes(pinned, bundle)):
        result.unreplayable = ("the candidate changes the model (" + ", ".join(p for p, _, _ in changed)
                               + "): recorded replies cannot judge it (use --live)")
        return result
    version = bundle.get("reducer") or reducer.REDUCER_VERSION
    try:
        reduce = reducer.reducer_for(version)
    except reducer.UnknownReducer as exc:
        result.unreplayable = str(exc)
        return result
    events = list(TaskEvent.objects.filter(task_id=task.pk).order_by("seq").only("seq", "type", "payload"))
    state, since = reducer.initial_state(), 0
    for i, event in enumerate(events):
        malformed = (event.type == "model.called" and event.payload.get("outcome") == "malformed"
                     and (not live or _gave_up_after(events, i)))
        refused = event.type == "task.completed" and event.payload.get("reason") == "proposal_rejected" \
            and event.payload.get("refused")
        if malformed or event.type == "draft.proposed" or refused:
            try:
                point = _point(task, events, i, since, state, pinned, bundle, live)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                # a recorded state the candidate's code cannot read: not replayable, never a traceback
                point = Point(event.seq, {}, {}, unreplayable=f"the recorded state cannot be re-driven: "
                                                              f"{type(exc).__name__}: {exc}"[:300])
            result.points.append(point)
            if not malformed:
                since = i + 1
        try:
            state = reduce(state, event.type, event.payload)
        except reducer.IllegalTransition as exc:
            result.unreplayable = (f"{version} refuses the recorded event seq {event.seq} ({event.type}): "
                                   f"{exc.reason}")
            return result
    if not result.points:
        result.skipped = _no_point_reason(task, events)
    return result


@dataclass
class Totals:
    """Totals over a run: tasks, decision points, tasks and points with a decision divergence,
    divergences per field, describing changes per field, tasks and points that could not be
    re-driven (``unreplayable_*``; the gate fails on them), tasks without a decision point
    (``no_point_tasks``), tasks whose recorded inputs retention purged (``purged_tasks``: never
    checked, counted apart from both), and the run's wall time."""

    tasks: int = 0
    points: int = 0
    diverged_tasks: int = 0
    diverged_points: int = 0
    by_field: Counter = field(default_factory=Counter)
    changes: Counter = field(default_factory=Counter)
    unreplayable_tasks: int = 0
    unreplayable_points: int = 0
    no_point_tasks: int = 0
    purged_tasks: int = 0
    seconds: float = 0.0


def trajectories_replay(tasks, overrides: dict, *, live: bool = False, out=None) -> Totals:
    """Re-drive every task of ``tasks`` (an iterable of :class:`Task`) and write a per-task report
    to ``out`` (a text stream; None: nothing written). Returns the :class:`Totals`.

    The candidate is checked first, before any task is replayed: :func:`candidate_check` (raises
    :class:`BundleInvalid`) and :func:`candidate_judgeable` (raises :class:`BundleInvalid` or
    :class:`NotJudgeable`)."""
    candidate_check(overrides)
    tasks = list(tasks)
    candidate_judgeable(tasks, overrides, live=live)
    totals, started = Totals(), time.monotonic()

    def say(line: str) -> None:
        if out is not None:
            out.write(line + "\n")

    for task in tasks:
        replay = trajectory_replay(task, overrides, live=live)
        totals.tasks += 1
        if replay.purged:
            totals.purged_tasks += 1
            say(f"task {replay.task_id}: not checked: {replay.skipped}")
            continue
        if replay.skipped:
            totals.no_point_tasks += 1
            say(f"task {replay.task_id}: {replay.skipped}")
            continue
        diverged = [p for p in replay.points if p.divergences]
        lost = replay.unreplayable_points
        totals.points += len(replay.points)
        totals.diverged_points += len(diverged)
        totals.diverged_tasks += bool(diverged)
        totals.unreplayable_points += len(lost)
        totals.unreplayable_tasks += bool(lost or replay.unreplayable)
        for p in replay.points:
            totals.by_field.update(f for f, _, _ in p.divergences)
            totals.changes.update(p.changes)
        status = "DIVERGES" if diverged else "NOT REPLAYABLE" if (lost or replay.unreplayable) else "same decisions"
        if diverged and (lost or replay.unreplayable):
            status += ", NOT REPLAYABLE in part"
        say(f"task {replay.task_id}: {len(replay.points)} decision point(s), {status}")
        for p in replay.points:
            if p.unreplayable:
                say(f"  seq {p.seq}: not replayable: {p.unreplayable}")
                continue
            parts = [f"{f} {a!r} -> {b!r}" for f, a, b in p.divergences]
            if p.changes:
                parts.append("describing fields changed: " + ", ".join(p.changes))
            if parts or p.note:
                say(f"  seq {p.seq}: " + ("; ".join(parts) or "no change") + (f"  ({p.note})" if p.note else ""))
        if replay.unreplayable:
            say(f"  not replayable: {replay.unreplayable}")
    totals.seconds = time.monotonic() - started
    return totals
