"""Drafting (spec §16.1 step 2): one model call at a time, admitted by the ledger, bounded by the
deadline and the lease, recorded with its raw output before anything uses it; malformed replies are
re-asked and transient failures retried with backoff."""

from __future__ import annotations

import logging
import random
import time

from django.conf import settings
from django.utils import timezone

from apps.actions.digest import action_digest, action_identity
from apps.actions.registry import tool_get
from apps.agent.common import (
    actor_of,
    cancel_requested,
    closing_held,
    deadline_reason,
    fail,
    has_ledger,
)
from apps.agent.controllers import Controller, controller_for
from apps.core.digests import sha256_json
from apps.core.failpoints import failpoint
from apps.evidence.guard import injection_flags
from apps.llm.drafter import (
    PROMPT_TEMPLATE_VERSION,
    local_draft,
    render_prompt,
    rules_priority,
    rules_questions,
    rules_title,
)
from apps.llm.providers import TRANSIENT, CallResult, output_schema_for, provider_for, recordable_text
from apps.llm.screening import description_screen, instruction_flags, sentence_supported, sentences, state_sources
from apps.tasks import reducer
from apps.tasks.answer import answer_compose
from apps.tasks.budget import activity_timeout, budget_reserve, budget_settle
from apps.tasks.leases import Lease, task_lease_renew
from apps.tasks.models import Task
from apps.tasks.reducer import v3 as reducer_v3
from apps.tasks.runs import checkpoint
from apps.tasks.store import task_append_event
from apps.tasks.usage import BudgetExceeded
from apps.tickets.selectors import sla_policy_for
from apps.tickets.sla import SlaConfigError

log = logging.getLogger(__name__)


def propose(task: Task, lease: Lease) -> bool:
    state = task.state
    limit = settings.FAULTDESK["MAX_REDRAFTS"]
    if state["redrafts"] > limit:
        task_append_event(task=task, event_type="task.failed", actor=actor_of(lease), lease_generation=lease.generation,
                          payload={"reason": f"redraft_limit: no valid draft after {limit} re-drafts"})
        return False
    if has_ledger(task):
        task, draft, again = _model_draft(task, lease)
        if draft is None:
            return again
        state = task.state
    else:
        draft = _model_call(task, state)
    draft = with_due_date(task, draft)
    proposal = plan(state, draft)
    refused = rejection_covering(state, proposal, controller_for(task.artifact_bundle))
    if refused is not None:
        # The same action was rejected earlier in the task — byte for byte, or (controller/2) re-worded:
        # a rejection is a constraint, never a reason to ask the approver again (spec §16.6).
        final = {**state, "proposal": None, "termination_reason": "proposal_rejected"}
        payload = {"reason": "proposal_rejected", "answer": answer_compose(final)}
        if refused:
            payload["refused"] = {"identity": refused["identity"], "digest": proposal["digest"],
                                  "rejected_by_approval": refused["approval_id"], "rejection_reason": refused["reason"],
                                  "title": (draft.get("ticket") or {}).get("title")}
        task_append_event(task=task, event_type="task.completed", actor=actor_of(lease),
                          lease_generation=lease.generation, payload=payload,
                          side_effects=closing_held(task, "task.completed"))
        return False
    task_append_event(
        task=task, event_type="draft.proposed", actor=actor_of(lease), lease_generation=lease.generation,
        payload={"draft": draft, "model": draft["model"], "prompt_template": task.artifact_bundle["prompt_template"],
                 "proposed_at": timezone.now().isoformat()},
    )
    return True


def rejection_covering(state: dict, proposal: dict, controller: Controller) -> dict | None:
    """Whether ``proposal`` repeats an action rejected earlier in the task: None when it does not;
    ``{}`` when its exact digest was rejected; under a controller that refuses by identity
    (``controller/2`` with ``reducer/5``'s ``rejections``), the rejection — ``{"approval_id",
    "identity", "digest", "reason", "decided_by"}`` — whose action identity (tool, target, kind of
    change; never the wording) it has."""
    if controller.rejection_by_identity:
        identity = action_identity(tool=proposal["tool"], params=proposal["params"])
        for rejection in state.get("rejections") or []:
            if rejection["identity"] == identity:
                return rejection
    return {} if proposal["digest"] in state["rejected_digests"] else None


def with_due_date(task: Task, draft: dict) -> dict:
    """``draft`` with its ticket's ``due_at``: when a ticket at the draft's priority is due to be
    resolved under the tenant's service levels, counted from the request's filing (apps/tickets/sla.py).
    The policy decides it, never the model; it is recorded with the draft (``draft.proposed``) and
    so approved and sent as part of the ticket's parameters. A draft without a ticket, or a tenant
    whose SLA policy cannot give a date (logged), is returned as it is."""
    ticket = draft.get("ticket") if isinstance(draft, dict) else None
    if not isinstance(ticket, dict):
        return draft
    # A re-draft at the same priority keeps the date its first draft got (reducer/4's ticket_due):
    # a policy edited meanwhile does not move it, nor make a rejected proposal look new.
    kept = ((task.state or {}).get("ticket_due") or {}).get(ticket.get("priority"))
    if kept:
        return {**draft, "ticket": {**ticket, "due_at": kept}}
    try:
        due = sla_policy_for(task.tenant_id).deadlines(task.created_at, ticket.get("priority")).resolve_by
    except SlaConfigError as exc:
        log.warning("tenant %s: no due date for task %s's ticket: %s", task.tenant_id, task.pk, exc)
        return draft
    return {**draft, "ticket": {**ticket, "due_at": due.isoformat(timespec="seconds")}}


def _model_call(task: Task, state: dict) -> dict:
    """Ask the pinned model for a ticket draft. The output is returned to be recorded as an event
    before anything uses it (a crash before that loses only this call: the next run makes a new,
    recorded decision)."""
    draft = local_draft(
        request=state["request"], device=state["device"], evidence=state["evidence"] or [],
        tenant=task.tenant.slug, requester=task.requester.get_username(), answers=state.get("answers") or [],
        selection=state.get("selection"),
    )
    failpoint("model_call")
    return draft


def _model_draft(task: Task, lease: Lease) -> tuple[Task, dict | None, bool]:
    """One call to the model pinned in the task's artifact bundle (``reducer/3``; DESIGN.md §8, §10): reserve its
    tokens, cost units and — when it repeats an attempt that gave no draft —
    one retry; give it a deadline-bounded timeout; make the call, cancellable; settle the real
    cost in ``model.called`` with the raw output, before anything uses it.

    Returns ``(task, draft, again)``: the draft to propose, or None with ``again`` True when the
    next step should try again (a malformed reply gets a re-ask, a 429/5xx/timeout a retry after
    a backoff) and False when the task stopped (cancelled, failed with the reason recorded)."""
    conf = settings.FAULTDESK
    state, gen, actor = task.state, lease.generation, actor_of(lease)
    m = state["model"]
    if m["reasks"] > conf["MODEL_MAX_REASKS"]:
        problems = "; ".join((m["last"] or {}).get("problems") or [])[:400]
        return fail(task, lease, f"model_output_invalid: no usable reply after {m['reasks'] - 1} re-asks "
                                  f"(last: {problems})"), None, False
    provider = provider_for(task.artifact_bundle, conf)
    last = m["last"]
    amounts = {"retries": 1 if last is not None else 0}
    messages, schema = None, None
    if provider is not None:
        if controller_for(task.artifact_bundle).rules_decide:
            schema = output_schema_for([str(r["chunk_id"]) for r in state["evidence"] or []])
        feedback = (last or {}).get("problems") if (last or {}).get("outcome") == "malformed" else m.get("feedback")
        messages = render_prompt(request=state["request"], device=state["device"], evidence=state["evidence"] or [],
                                 answers=state.get("answers") or [], feedback=feedback or (),
                                 template=task.artifact_bundle.get("prompt_template", PROMPT_TEMPLATE_VERSION))
        amounts.update(provider.reservation(messages, schema))
    # The call must end (and be recorded) while this worker still holds the lease: renew it, and
    # bound the call by the lease as well as by the task's deadline.
    task_lease_renew(lease=lease)
    lease_room = max(conf["LEASE_SECONDS"] - conf["ACTIVITY_CLEANUP_SECONDS"], conf["LEASE_SECONDS"] / 2)
    timeout = activity_timeout(task, wanted=min(conf["MODEL_TIMEOUT_SECONDS"], lease_room))
    if timeout is None:
        return fail(task, lease, deadline_reason(task)), None, False
    try:
        task, res = budget_reserve(task_id=task.pk, activity="model_call", amounts=amounts, actor=actor,
                                   lease_generation=gen, timeout_s=timeout, task=task)
    except BudgetExceeded as exc:
        return fail(task, lease, exc.reason), None, False
    call = {"provider": task.artifact_bundle.get("model_provider", "local"), "model": task.artifact_bundle["model"],
            "prompt_template": task.artifact_bundle["prompt_template"], "attempt": m["calls"] + 1,
            "timeout_s": timeout}
    if provider is None:
        started = timezone.now()
        draft = _model_call(task, state)
        latency = int((timezone.now() - started).total_seconds() * 1000)
        task = budget_settle(task_id=task.pk, reservation_id=res.id, used={"retries": amounts["retries"]},
                             actor=actor, lease_generation=gen, event_type="model.called",
                             extra={**call, "outcome": "ok", "usage": None, "latency_ms": latency}, task=task)
        return task, draft, True
    with checkpoint():  # the reservation is committed before the call leaves the process
        try:
            result = provider.complete(messages, timeout=timeout, schema=schema,
                                       should_stop=lambda: cancel_requested(task.pk),
                                       poll_seconds=conf["CANCEL_POLL_SECONDS"])
        except Exception as exc:  # noqa: BLE001 - recorded (charged in full) and ends in a decision, never re-sent blind
            log.exception("model call for %s failed inside the provider", task.pk)
            result = CallResult(outcome="error", error=f"provider failed: {type(exc).__name__}: {exc}"[:300])
        failpoint("model_call")
    if result.error:  # a server's error text may hold U+0000, which PostgreSQL cannot store
        result.error = recordable_text(result.error)
    used, overrun = provider.cost(result, res.amounts)
    task = budget_settle(
        task_id=task.pk, reservation_id=res.id, used={**used, "retries": amounts["retries"]}, actor=actor,
        lease_generation=gen, event_type="model.called",
        extra={**call, "outcome": result.outcome, "http_status": result.http_status, "usage": result.usage,
               "overrun": overrun, "latency_ms": result.latency_ms, "problems": result.problems,
               # the whole reply, as received (bounded by FAULTDESK_MODEL_MAX_REPLY_BYTES): replay
               # re-parses it, so a cut copy would hide what a candidate parser or controller does
               "error": result.error, "output": recordable_text(result.content) if result.content else None,
               "output_truncated": False,
               "request_digest": sha256_json(messages)},
    )
    if result.outcome == "ok":
        draft = draft_from_output(state=task.state, output=result.output, model=provider.model,
                                  tenant=task.tenant.slug, requester=task.requester.get_username(),
                                  controller=controller_for(task.artifact_bundle))
        return task, draft, True
    if result.outcome == "cancelled" or task.status in reducer.TERMINAL:
        return task, None, False
    if result.outcome == "error":
        return fail(task, lease, f"model_error: {result.error}"[:300]), None, False
    if result.outcome in TRANSIENT and reducer_v3.headroom(task.state)["retries"] >= 1:
        with checkpoint():  # the call is recorded before the wait
            _backoff(task, lease, result, attempt=m["calls"])  # no wait when no retry is left: the next step ends it
    return task, None, True  # a re-ask (malformed) or a retry (transient), each admitted by the ledger


def _backoff(task: Task, lease: Lease, result, *, attempt: int) -> None:
    """Wait before retrying a model call: exponential with full jitter (or the server's
    Retry-After), never past a third of the lease nor into the time the task needs to finish."""

    conf = settings.FAULTDESK
    wait = random.uniform(0, conf["RETRY_BACKOFF_BASE_SECONDS"] * 2 ** min(attempt, 6))  # noqa: S311 - jitter
    if result.retry_after is not None:
        wait = max(wait, result.retry_after)
    left = (task.deadline_at - timezone.now()).total_seconds() - conf["ACTIVITY_CLEANUP_SECONDS"]
    wait = min(wait, 60.0, conf["LEASE_SECONDS"] / 3, max(left, 0))
    until = time.monotonic() + wait
    while time.monotonic() < until:
        if cancel_requested(task.pk):
            return  # the next step sees the cancel and stops
        time.sleep(min(conf["CANCEL_POLL_SECONDS"], max(until - time.monotonic(), 0)))


def draft_from_output(*, state: dict, output: dict, model: str, tenant: str, requester: str,
                      controller: Controller) -> dict:
    """The ticket draft from a parsed model reply (``output``: :data:`~apps.llm.providers.MODEL_OUTPUT_SCHEMA`)
    over a task's recorded ``state``. Device, tenant, requester and labels always come from the
    state (the model cannot choose them). Pure: the same inputs, the same draft — what a trajectory
    replay re-drives (apps/agent/trajectories.py).

    Under a controller whose rules decide (``controller/2``; apps/agent/controllers.py):

    * ``priority`` is :func:`~apps.llm.drafter.rules_priority`'s; the model's is kept in
      ``draft["suggested"]["priority"]``, and ``draft["outside_rules"]`` lists each suggestion the
      rules did not take (``{"field", "suggested", "decided"}``) for the approver;
    * the requester is asked only what :func:`~apps.llm.drafter.rules_questions` asks (the model's
      questions are suggestions; they are asked in its words when the rules would ask);
    * the title and description are screened (:mod:`apps.llm.screening`): unsupported sentences
      are dropped (a title with an unsupported claim gives way to the rules' title), a citation of a
      chunk that was not retrieved is dropped too, and
      ``draft["screening"]`` = ``{"dropped": [{"field", "text"}], "flags": [{"source", "flags"}]}``.

    Under ``controller/1`` the reply is the draft, as it was."""
    device = state["device"]
    labels = sorted({device["kind"], f"site:{device.get('site') or 'unknown'}", "faultdesk"})
    ticket = {"title": output["title"], "description": output["description"], "priority": output["priority"],
              "device": device["asset_tag"], "tenant": tenant, "requester": requester,
              "labels": labels, "evidence": list(output["evidence"])}
    draft = {"ticket": ticket, "alert_summary": output["alert_summary"],
             "missing_information": list(output["missing_information"]), "model": model}
    if not controller.rules_decide:
        return draft
    request, answers = state["request"], state.get("answers") or []
    decided = rules_priority(request=request, device=device)
    questions = rules_questions(request=request, answers=answers)
    draft["suggested"] = {"priority": output["priority"], "missing_information": list(output["missing_information"])}
    draft["outside_rules"] = ([{"field": "priority", "suggested": output["priority"], "decided": decided}]
                              if output["priority"] != decided else [])
    ticket["priority"] = decided
    draft["missing_information"] = (list(output["missing_information"]) or questions) if questions else []
    if controller.screens and questions:
        # the model's questions reach the requester: one that reads as an instruction ("reply with
        # your password") is not asked, and if none is left the rules' questions are
        asked = [q for q in draft["missing_information"] if not injection_flags(q)]
        draft["missing_information"] = asked or questions
    if controller.screens:
        sources = state_sources(state)
        dropped = []
        description, cut = description_screen(output["description"], sources)
        dropped += [{"field": "description", "text": t} for t in cut]
        if len(description) < 10:
            description = local_draft(request=request, device=device, evidence=state.get("evidence") or [],
                                      tenant=tenant, requester=requester, answers=answers,
                                      selection=state.get("selection"))["ticket"]["description"]
        title = output["title"]
        if not all(sentence_supported(t, sources) for t in sentences(title)):
            dropped.append({"field": "title", "text": title})
            title = rules_title(request=request, device=device, answers=answers)
        retrieved = {str(r["chunk_id"]) for r in state.get("evidence") or []}
        dropped += [{"field": "evidence", "text": str(ref)} for ref in ticket["evidence"] if str(ref) not in retrieved]
        ticket["evidence"] = [ref for ref in ticket["evidence"] if str(ref) in retrieved]
        ticket["title"], ticket["description"] = title, description
        dropped += [{"field": "question", "text": q} for q in output["missing_information"]
                    if questions and q not in draft["missing_information"]]
        flags = instruction_flags({"title": output["title"], "description": output["description"],
                                   **{f"question {i + 1}": q for i, q in enumerate(output["missing_information"])}})
        if title != output["title"] and (final := injection_flags(title)):
            # the rules' title is built from the report and the device's fields: flagged where it goes out
            flags.append({"source": "ticket title", "flags": final})
        draft["screening"] = {"dropped": dropped, "flags": flags}
    return draft


def plan(state: dict, draft: dict) -> dict:
    """The write the draft leads to, as a proposal ``{tool, tool_version, params, digest}``: a
    comment on the device's open ticket when the plan read one (``reducer/2``), conditional on
    the version read; otherwise a new ticket. The report's attachments (name, type, size, digest)
    are part of either's parameters. Pure: the same state and draft, the same proposal."""
    ticket, t = state.get("ticket"), draft["ticket"]
    if ticket:
        tool = tool_get("ticket.comment")
        body = (f"New report for {t['device']} from {t['requester']} ({t['priority']}): {t['title']}\n\n"
                f"{t['description']}")[:8000]
        params = {"ticket_id": ticket["external_id"], "if_match": ticket["version"], "body": body,
                  "device": t["device"], "evidence": t["evidence"]}
    else:
        tool = tool_get("ticket.create")
        params = t
    # The report's files go with the write: approved with it (their digests are in its parameters,
    # so its digest), and sent to the ticket once it exists (apps/attachments/delivery.py).
    files = [{k: a[k] for k in ("name", "content_type", "size", "sha256")}
             for a in (state.get("request") or {}).get("attachments") or []]
    if files:
        params = {**params, "attachments": files}
    digest = action_digest(tool=tool.name, tool_version=tool.version, params=params)
    return {"tool": tool.name, "tool_version": tool.version, "params": params, "digest": digest}
