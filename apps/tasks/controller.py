"""The agent controller (DESIGN.md §1 steps 2–6, §5; spec algorithm 16.1 steps 1–3).

Each step runs under a lease on the task and commits through :func:`task_append_event` with the
lease's fencing token, so a worker that lost its lease cannot commit. Non-deterministic inputs
(retrieval, device reads, model output, the clock) are recorded as events before anything uses
them. The controller is re-entrant: it looks at the recorded state and does the next thing, so a
crash anywhere resumes from the last event.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.accounts.models import Membership
from apps.accounts.principal import principal_current
from apps.actions import errors
from apps.actions.digest import action_digest, idempotency_key, proposal_digest, sha256_json
from apps.actions.models import Action
from apps.actions.registry import ParamsInvalid, params_validate, tool_get
from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_check_binding_now, approval_invalidate, policy_decide
from apps.devices.selectors import device_read
from apps.events.models import TaskEvent
from apps.evidence.guard import injection_flags, refs_flags
from apps.evidence.relevance import evidence_select
from apps.llm.drafter import local_draft, render_prompt
from apps.llm.parser import draft_validate
from apps.llm.providers import TRANSIENT, CallResult, provider_for
from apps.outbox.models import OutboxMessage
from apps.tasks import reducer, reducer_v2, reducer_v3
from apps.tasks.answer import answer_compose
from apps.tasks.budget import (
    BudgetExceeded,
    activity_timeout,
    budget_reserve,
    budget_settle,
    stale_reservations,
)
from apps.tasks.failpoints import failpoint
from apps.tasks.models import Task
from apps.tasks.services import (
    Lease,
    StaleWrite,
    refused_event_record,
    task_append_event,
    task_claim,
    task_lease_renew,
    task_release,
)
from apps.tickets.connectors import CONNECTORS, connector_for
from apps.tickets.selectors import open_ticket_read, ticket_snapshot
from config.logs import bind

log = logging.getLogger(__name__)

MAX_STEPS_PER_RUN = 20


def _actor(lease: Lease) -> str:
    return f"worker:{lease.owner}"


def _principal_scopes(task: Task) -> list[str]:

    p = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    return list(p.scopes) if p else []


def _report_text(task: Task) -> str:
    """What the requester reported: the symptom and the answers given since (the device's alert is
    matched separately, so it cannot drown the report; apps.evidence.relevance)."""
    return " ".join(p for p in [task.symptom, *task.state.get("answers", [])] if p)


#: device fields a person can type into (names, messages): checked for instructions like a report
_DEVICE_TEXT_FIELDS = ("name", "alert_message", "site", "model")


def _input_flags(task: Task, reading: dict | None) -> list[dict]:
    """``[{"source", "flags"}]`` for the report, the requester's answers and the device's text
    fields that read like instructions to an agent (DESIGN.md §9): recorded with the retrieval,
    shown on the trace and the approval queue, and changing nothing else."""
    out = []
    for i, text in enumerate([task.symptom, *task.state.get("answers", [])]):
        if flags := injection_flags(text):
            out.append({"source": "report" if i == 0 else f"answer {i}", "flags": flags})
    for name in _DEVICE_TEXT_FIELDS:
        if flags := injection_flags(str((reading or {}).get(name) or "")):
            out.append({"source": f"device field {name}", "flags": flags})
    return out


def context_read(*, task_id: uuid.UUID) -> None:
    """The ``tools`` step: retrieval and the device read, each recorded as an event
    (``evidence.retrieved``, ``device.read``; ``ticket.read`` from ``reducer/2`` on). Runs only in
    ``RETRIEVING``. Under ``reducer/3`` the reads are one activity: admitted by a reservation of
    their tool calls, given a deadline-bounded timeout, and settled at the calls made."""
    lease = task_claim(task_id=task_id)
    if lease is None:
        return
    device_gone = False
    try:
        task = Task.objects.select_related("device", "tenant").get(pk=task_id)
        bind(tenant_id=task.tenant_id, task_id=task.pk, lease_generation=lease.generation, step="context_read")
        if task.status != reducer.RETRIEVING:
            return
        gen = lease.generation
        reservation, timeout = None, None
        if _v3(task):
            task = _release_stale(task, lease)
            calls = 2 + (task.state["evidence"] is None)  # device read, ticket read, retrieval
            timeout = activity_timeout(task, wanted=settings.FAULTDESK["REFSERVICE_TIMEOUT_SECONDS"])
            if timeout is None:
                _fail(task, lease, _deadline_reason(task))
                return
            try:
                task, reservation = budget_reserve(task_id=task.pk, activity="context_read",
                                                   amounts={"tool_calls": calls}, actor=_actor(lease),
                                                   lease_generation=gen, timeout_s=timeout)
            except BudgetExceeded as exc:
                _fail(task, lease, exc.reason)
                return
        made = 0
        try:
            made += 1
            reading = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
            if task.state["evidence"] is None:
                made += 1
                selection = evidence_select(
                    tenant_id=task.tenant_id,
                    scopes=_principal_scopes(task),
                    report=_report_text(task),
                    device=reading,
                    k=settings.FAULTDESK["RETRIEVAL_TOP_K"],
                    model=task.artifact_bundle.get("embedding_model"),
                )
                ref_dicts = [r.as_dict() for r in selection.refs]
                chosen = selection.as_dict()
                chosen.pop("refs")
                payload = {"query": _report_text(task), "refs": ref_dicts, "selection": chosen,
                           "retrieved_at": timezone.now().isoformat()}
                if flagged := refs_flags(ref_dicts) + _input_flags(task, reading):
                    payload["injection_flags"] = flagged  # shown on the trace and queue; nothing else changes
                    chosen["injection_flags"] = flagged
                task = task_append_event(
                    task=task, event_type="evidence.retrieved", actor=_actor(lease), lease_generation=gen,
                    payload=payload,
                )
            # A device gone from the tenant: settle the reads made (below), then fail the task.
            if reading is None:
                device_gone = True
            else:
                if _v2(task):
                    # The device's open ticket, read at its ticket system: the plan may comment on it.
                    made += 1
                    try:
                        ticket = open_ticket_read(tenant_id=task.tenant_id, device_id=task.device_id,
                                                  connector=task.tenant.ticket_system, timeout=timeout)
                    except errors.ToolError as exc:
                        log.info("context_read %s: the ticket system cannot be read now (%s); retried later",
                                 task_id, exc)
                        return
                    task = task_append_event(task=task, event_type="ticket.read", actor=_actor(lease),
                                             lease_generation=gen,
                                             payload={"ticket": ticket, "read_at": timezone.now().isoformat()})
                task = task_append_event(
                    task=task, event_type="device.read", actor=_actor(lease), lease_generation=gen,
                    payload={"reading": reading, "read_at": timezone.now().isoformat()},
                )
        finally:
            if reservation is not None:
                task = budget_settle(task_id=task.pk, reservation_id=reservation.id, used={"tool_calls": made},
                                     actor=_actor(lease), lease_generation=gen)
        if device_gone:
            _fail(task, lease, "device no longer exists in the tenant")
            return
    except StaleWrite:
        log.info("context_read lost the lease on %s", task_id)
        return
    except reducer.IllegalTransition as exc:
        log.warning("context_read on %s: %s", task_id, exc)  # recorded as a refused event
        return
    finally:
        task_release(lease=lease)
    from apps.tasks.tasks import enqueue_agent_step

    enqueue_agent_step(task_id)


def _fail(task: Task, lease: Lease, reason: str) -> Task:
    """Record the explicit terminal decision ``task.failed`` with ``reason``."""
    return task_append_event(task=task, event_type="task.failed", actor=_actor(lease),
                             lease_generation=lease.generation,
                             payload={"reason": reason, "at": timezone.now().isoformat()})


def _deadline_reason(task: Task) -> str:
    left = (task.deadline_at - timezone.now()).total_seconds()
    return (f"deadline_exceeded: {max(left, 0):.1f} s left, less than an activity needs plus "
            f"{settings.FAULTDESK['ACTIVITY_CLEANUP_SECONDS']:.0f} s to record its result")


def _release_stale(task: Task, lease: Lease) -> Task:
    """Close the open reservations of earlier leases before this lease starts new activities
    (``reducer/3``): their workers died or were fenced and will never settle them. What they did
    is unknown — a model call may have been answered and billed — so each is charged at its
    reservation (``c = r``), which also bounds an activity that keeps crashing."""
    for rid in stale_reservations(task, lease.generation):
        task = budget_settle(task_id=task.pk, reservation_id=rid, actor=_actor(lease),
                             lease_generation=lease.generation,
                             used=task.state["reservations"][rid]["amounts"],
                             extra={"unknown_outcome": True,
                                    "reason": f"made under an earlier lease (fencing token < {lease.generation}) "
                                              "and never settled: charged at its reservation"})
    return task


def agent_run(*, task_id: uuid.UUID) -> None:
    """Run the agent's next steps for ``task_id`` until it waits, ends or hands work to another
    queue. Returns quietly when another worker holds the lease or the task is terminal."""
    from apps.tasks.tasks import enqueue_read_context

    lease = task_claim(task_id=task_id)
    if lease is None:
        return
    try:
        task = Task.objects.get(pk=task_id)
        bind(tenant_id=task.tenant_id, task_id=task.pk, lease_generation=lease.generation, step="agent_run")
        if _v3(task):
            _release_stale(task, lease)
        for _ in range(MAX_STEPS_PER_RUN):
            task = Task.objects.select_related("device", "tenant", "requester").get(pk=task_id)
            try:
                if not _step(task, lease):
                    break
            except BudgetExceeded as exc:
                # e.g. the tenant's daily quota refused an intent's reservation: nothing was written
                task = Task.objects.select_related("tenant").get(pk=task_id)
                if task.status in reducer.TERMINAL or task.status == reducer.WAITING_COMPENSATION:
                    break
                event = "compensation.failed" if task.status == reducer.COMPENSATING else "task.failed"
                task_append_event(task=task, event_type=event, actor=_actor(lease), lease_generation=lease.generation,
                                  payload={"reason": exc.reason})
                break
    except StaleWrite:
        log.info("agent_run lost the lease on %s", task_id)
    except reducer.IllegalTransition as exc:
        # Already recorded as a refused event; the task stays as it was.
        log.warning("agent_run on %s: %s", task_id, exc)
    finally:
        task_release(lease=lease)
    # Hand retrieval to the tools queue only now that the lease is free for its worker to claim.
    if Task.objects.filter(pk=task_id, status=reducer.RETRIEVING).exists():
        enqueue_read_context(task_id)


def _step(task: Task, lease: Lease) -> bool:
    """Do one step; return True when another step should follow immediately."""
    gen, actor = lease.generation, _actor(lease)
    status = task.status
    if status == reducer.CANCELLED and _compensation_due(task):
        return _compensation_request(task, lease, ticket=_created_ticket(task.state["receipt"]))
    if status == reducer.COMPENSATING:
        return _compensate(task, lease)  # bounded by its approval's expiry, re-plan limit and window
    if status in reducer.TERMINAL or status == reducer.WAITING_COMPENSATION:
        return False  # a failed compensation waits for a person, whatever the task's deadline
    exceeded = _bounds_exceeded(task)
    if exceeded and status not in (reducer.DISPATCHING, reducer.WAITING_RECONCILIATION):
        # An action in flight is finished (receipt or reconciliation) before the task may end.
        task_append_event(task=task, event_type="task.failed", actor=actor, lease_generation=gen,
                          payload={"reason": exceeded, "at": timezone.now().isoformat()})
        return False
    if status == reducer.ACCEPTED:
        task_append_event(task=task, event_type="retrieval.started", actor=actor, lease_generation=gen, payload={})
        return False  # agent_run hands RETRIEVING to the tools queue after releasing the lease
    if status == reducer.RETRIEVING:
        return False
    if status == reducer.PROPOSING:
        return _propose(task, lease)
    if status == reducer.VALIDATING:
        return _validate_and_authorize(task, lease)
    if status == reducer.WAITING_APPROVAL:
        return _resume_after_approval(task, lease)
    if status == reducer.DISPATCHING and task.state["receipt"] is not None:
        reason = "ticket_commented" if task.state["receipt"].get("kind") == "comment" else "ticket_created"
        task_append_event(task=task, event_type="task.completed", actor=actor, lease_generation=gen,
                          payload={"reason": reason, "answer": answer_compose(task.state)})
        return False
    return False  # WAITING_INPUT, DISPATCHING without receipt, WAITING_RECONCILIATION: someone else acts


def _propose(task: Task, lease: Lease) -> bool:
    state = task.state
    limit = settings.FAULTDESK["MAX_REDRAFTS"]
    if state["redrafts"] > limit:
        task_append_event(task=task, event_type="task.failed", actor=_actor(lease), lease_generation=lease.generation,
                          payload={"reason": f"redraft_limit: no valid draft after {limit} re-drafts"})
        return False
    if _v3(task):
        task, draft, again = _model_draft(task, lease)
        if draft is None:
            return again
        state = task.state
    else:
        draft = _model_call(task, state)
    digest = _plan(state, draft)["digest"]
    if digest in state["rejected_digests"]:
        # The local drafter is deterministic: it cannot propose something materially different.
        final = {**state, "proposal": None, "termination_reason": "proposal_rejected"}
        task_append_event(task=task, event_type="task.completed", actor=_actor(lease),
                          lease_generation=lease.generation,
                          payload={"reason": "proposal_rejected", "answer": answer_compose(final)})
        return False
    task_append_event(
        task=task, event_type="draft.proposed", actor=_actor(lease), lease_generation=lease.generation,
        payload={"draft": draft, "model": draft["model"], "prompt_template": task.artifact_bundle["prompt_template"],
                 "proposed_at": timezone.now().isoformat()},
    )
    return True


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


def _cancel_requested(task_id: uuid.UUID) -> bool:
    """Has the task been cancelled (or ended) since this worker started its activity?"""
    row = Task.objects.filter(pk=task_id).values("status", "state__cancel_requested").first()
    return row is None or row["status"] in reducer.TERMINAL or bool(row["state__cancel_requested"])


def _model_draft(task: Task, lease: Lease) -> tuple[Task, dict | None, bool]:
    """One call to the model pinned in the task's artifact bundle (``reducer/3``; issue 7 items
    1, 2, 4): reserve its tokens, cost units and — when it repeats an attempt that gave no draft —
    one retry; give it a deadline-bounded timeout; make the call, cancellable; settle the real
    cost in ``model.called`` with the raw output, before anything uses it.

    Returns ``(task, draft, again)``: the draft to propose, or None with ``again`` True when the
    next step should try again (a malformed reply gets a re-ask, a 429/5xx/timeout a retry after
    a backoff) and False when the task stopped (cancelled, failed with the reason recorded)."""
    conf = settings.FAULTDESK
    state, gen, actor = task.state, lease.generation, _actor(lease)
    m = state["model"]
    if m["reasks"] > conf["MODEL_MAX_REASKS"]:
        problems = "; ".join((m["last"] or {}).get("problems") or [])[:400]
        return _fail(task, lease, f"model_output_invalid: no usable reply after {m['reasks'] - 1} re-asks "
                                  f"(last: {problems})"), None, False
    provider = provider_for(task.artifact_bundle, conf)
    last = m["last"]
    amounts = {"retries": 1 if last is not None else 0}
    messages = None
    if provider is not None:
        feedback = (last or {}).get("problems") if (last or {}).get("outcome") == "malformed" else m.get("feedback")
        messages = render_prompt(request=state["request"], device=state["device"], evidence=state["evidence"] or [],
                                 answers=state.get("answers") or [], feedback=feedback or ())
        amounts.update(provider.reservation(messages))
    # The call must end (and be recorded) while this worker still holds the lease: renew it, and
    # bound the call by the lease as well as by the task's deadline.
    task_lease_renew(lease=lease)
    lease_room = max(conf["LEASE_SECONDS"] - conf["ACTIVITY_CLEANUP_SECONDS"], conf["LEASE_SECONDS"] / 2)
    timeout = activity_timeout(task, wanted=min(conf["MODEL_TIMEOUT_SECONDS"], lease_room))
    if timeout is None:
        return _fail(task, lease, _deadline_reason(task)), None, False
    try:
        task, res = budget_reserve(task_id=task.pk, activity="model_call", amounts=amounts, actor=actor,
                                   lease_generation=gen, timeout_s=timeout)
    except BudgetExceeded as exc:
        return _fail(task, lease, exc.reason), None, False
    call = {"provider": task.artifact_bundle.get("model_provider", "local"), "model": task.artifact_bundle["model"],
            "prompt_template": task.artifact_bundle["prompt_template"], "attempt": m["calls"] + 1,
            "timeout_s": timeout}
    if provider is None:
        started = timezone.now()
        draft = _model_call(task, state)
        latency = int((timezone.now() - started).total_seconds() * 1000)
        task = budget_settle(task_id=task.pk, reservation_id=res.id, used={"retries": amounts["retries"]},
                             actor=actor, lease_generation=gen, event_type="model.called",
                             extra={**call, "outcome": "ok", "usage": None, "latency_ms": latency})
        return task, draft, True
    try:
        result = provider.complete(messages, timeout=timeout, should_stop=lambda: _cancel_requested(task.pk),
                                   poll_seconds=conf["CANCEL_POLL_SECONDS"])
    except Exception as exc:  # noqa: BLE001 - recorded (charged in full) and ends in a decision, never re-sent blind
        log.exception("model call for %s failed inside the provider", task.pk)
        result = CallResult(outcome="error", error=f"provider failed: {type(exc).__name__}: {exc}"[:300])
    failpoint("model_call")
    used, overrun = provider.cost(result, res.amounts)
    task = budget_settle(
        task_id=task.pk, reservation_id=res.id, used={**used, "retries": amounts["retries"]}, actor=actor,
        lease_generation=gen, event_type="model.called",
        extra={**call, "outcome": result.outcome, "http_status": result.http_status, "usage": result.usage,
               "overrun": overrun, "latency_ms": result.latency_ms, "problems": result.problems,
               "error": result.error, "output": (result.content or "")[:8000] if result.content else None,
               "request_digest": sha256_json(messages)},
    )
    if result.outcome == "ok":
        return task, _draft_from_output(task, result.output, provider.model), True
    if result.outcome == "cancelled" or task.status in reducer.TERMINAL:
        return task, None, False
    if result.outcome == "error":
        return _fail(task, lease, f"model_error: {result.error}"[:300]), None, False
    if result.outcome in TRANSIENT and reducer_v3.headroom(task.state)["retries"] >= 1:
        _backoff(task, lease, result, attempt=m["calls"])  # no wait when no retry is left: the next step ends it
    return task, None, True  # a re-ask (malformed) or a retry (transient), each admitted by the ledger


def _backoff(task: Task, lease: Lease, result, *, attempt: int) -> None:
    """Wait before retrying a model call: exponential with full jitter (or the server's
    Retry-After), never past a third of the lease nor into the time the task needs to finish."""
    import random
    import time

    conf = settings.FAULTDESK
    wait = random.uniform(0, conf["RETRY_BACKOFF_BASE_SECONDS"] * 2 ** min(attempt, 6))  # noqa: S311 - jitter
    if result.retry_after is not None:
        wait = max(wait, result.retry_after)
    left = (task.deadline_at - timezone.now()).total_seconds() - conf["ACTIVITY_CLEANUP_SECONDS"]
    wait = min(wait, 60.0, conf["LEASE_SECONDS"] / 3, max(left, 0))
    until = time.monotonic() + wait
    while time.monotonic() < until:
        if _cancel_requested(task.pk):
            return  # the next step sees the cancel and stops
        time.sleep(min(conf["CANCEL_POLL_SECONDS"], max(until - time.monotonic(), 0)))


def _draft_from_output(task: Task, output: dict, model: str) -> dict:
    """The ticket draft from a parsed model reply: the model's content, with device, tenant,
    requester and labels taken from the task's recorded state (the model cannot choose them)."""
    device = task.state["device"]
    labels = sorted({device["kind"], f"site:{device.get('site') or 'unknown'}", "faultdesk"})
    ticket = {"title": output["title"], "description": output["description"], "priority": output["priority"],
              "device": device["asset_tag"], "tenant": task.tenant.slug, "requester": task.requester.get_username(),
              "labels": labels, "evidence": list(output["evidence"])}
    return {"ticket": ticket, "alert_summary": output["alert_summary"],
            "missing_information": list(output["missing_information"]), "model": model}


def _write_short(task: Task, tool) -> str | None:
    """``reducer/3``: why the task's ledger has no room left for ``tool``'s write (its cost units
    and one tool call), as a termination reason; None when it fits. Checked before an approval is
    asked for and before the intent, so a write the budget cannot pay ends in a decision."""
    if not _v3(task):
        return None
    room = reducer_v3.headroom(task.state)
    for dim, need in (("money", tool.cost_units), ("tool_calls", 1)):
        if need > room[dim]:
            return f"budget_exhausted: task {dim}: the {tool.name} write needs {need}, {max(room[dim], 0)} left"
    return None


def _bounds_exceeded(task: Task) -> str | None:
    """The first bound this task has hit (issue 3: steps, re-plans — recursion depth — and wall
    time; re-drafts are checked where drafting happens), as a termination reason, or None."""
    conf = settings.FAULTDESK
    if task.version >= conf["MAX_EVENTS_PER_TASK"]:
        return f"step_limit: {task.version} events (limit {conf['MAX_EVENTS_PER_TASK']})"
    if task.state.get("replans", 0) > conf["MAX_REPLANS"]:
        return f"replan_limit: re-planned {task.state['replans']} times (limit {conf['MAX_REPLANS']})"
    if task.deadline_at <= timezone.now():
        return "deadline_exceeded"
    return None


REQUESTER_GONE = "requester no longer holds a requester role in the tenant"


def _requester_gone(task: Task) -> bool:
    """The requester's membership, role or account (``User.is_active``) is gone now."""
    requester = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    return requester is None or not requester.is_requester


def _premises_changed(task: Task) -> str | None:
    """Re-check what the plan assumed before resuming it (issue 3 item 6): the requester still
    belongs to the tenant and may still read every cited chunk. Returns what changed, or None."""
    from apps.evidence.selectors import chunk_readable

    requester = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    if requester is None or not requester.is_requester:
        return "requester_revoked"
    for ref in task.state.get("evidence") or []:
        if chunk_readable(chunk_id=ref["chunk_id"], tenant_id=task.tenant_id, scopes=requester.scopes) is None:
            return "requester's permissions changed: cited evidence no longer readable"
    return None


def _validate_and_authorize(task: Task, lease: Lease) -> bool:
    state, gen, actor = task.state, lease.generation, _actor(lease)
    draft, device = state["draft"], state["device"]
    problems = draft_validate(
        draft=draft, evidence_ids={str(r["chunk_id"]) for r in state["evidence"] or []},
        device_asset_tag=device["asset_tag"], tenant=task.tenant.slug,
    )
    if problems:
        if not state["evidence"]:
            task_append_event(task=task, event_type="task.failed", actor=actor, lease_generation=gen,
                              payload={"reason": "no readable evidence for this device and symptom"})
            return False
        task_append_event(task=task, event_type="draft.invalid", actor=actor, lease_generation=gen,
                          payload={"problems": problems})
        return True
    if draft["missing_information"]:
        task_append_event(task=task, event_type="input.requested", actor=actor, lease_generation=gen,
                          payload={"questions": draft["missing_information"]})
        return False
    proposal = _plan(state, draft)
    tool = tool_get(proposal["tool"])
    if short := _write_short(task, tool):
        _fail(task, lease, short)
        return False
    params, digest = proposal["params"], proposal["digest"]
    ticket = state.get("ticket") if tool.object_scope == "ticket" else None
    object_version = ticket["version"] if ticket else device["version"]
    selection = state.get("selection") or {}
    decision = policy_decide(tenant_id=task.tenant_id, tool=tool.name, evidence=state["evidence"] or [],
                             no_procedure=selection.get("reason", "") if selection.get("outcome") == "no_procedure"
                             else "")
    if decision.requires_approval:
        approval_id = uuid.uuid4()
        expires_at = timezone.now() + decision.ttl
        system = CONNECTORS[task.tenant.ticket_system].label
        if ticket:
            target = {"object_type": "ticket", "object_id": ticket["external_id"]}
            scope = f"{task.tenant.slug}:{tool.name}:ticket/{ticket['external_id']}"
            effects = (f"Adds one comment to ticket {ticket['external_id']} in {system}, only while the ticket is "
                       f"still at version {ticket['version']} (If-Match); no new ticket.")
        else:
            target = {"object_type": "device", "object_id": str(device["device_id"])}
            scope = f"{task.tenant.slug}:{tool.name}:device/{device['asset_tag']}"
            effects = f"Creates one ticket in {system} for {device['asset_tag']} with priority {params['priority']}."
        if decision.forced_by:
            effects += f" A person must approve: {decision.forced_by}."

        carried = _carried_over(task, proposal, decision)
        decided = {}
        if carried is not None:
            # The same low-risk write, approved before in this task; only the ticket's version moved.
            decided = {"status": "APPROVED", "decided_by_id": carried.decided_by_id, "decided_at": timezone.now(),
                       "reason": f"carried over from approval {carried.pk}: the same low-risk {tool.name}, only the "
                                 f"ticket version moved ({carried.object_version} → {object_version})"}
            expires_at = carried.expires_at

        def create_approval(t: Task, event) -> None:
            ApprovalRequest.objects.create(
                id=approval_id, tenant_id=t.tenant_id, task_id=t.pk, requested_by_id=t.requester_id,
                tool=tool.name, tool_version=tool.version, params=params, action_digest=digest,
                object_version=object_version, policy_version=decision.policy_version, scope=scope,
                approver_roles=list(decision.approver_roles),
                side_effects=effects, evidence=state["evidence"], expires_at=expires_at, **target, **decided,
            )

        payload = {"approval_id": str(approval_id), "proposal": proposal, "object_version": object_version,
                   "policy_version": decision.policy_version, "expires_at": expires_at.isoformat()}
        if decision.forced_by:
            payload["forced_by"] = decision.forced_by
        if carried is not None:
            payload.update(carried_over_from=str(carried.pk), decided_by=carried.decided_by.get_username())
        task_append_event(task=task, event_type="approval.requested", actor=actor, lease_generation=gen,
                          payload=payload, side_effects=create_approval)
        return carried is not None  # a carried-over approval is granted: commit the intent next
    return _commit_intent(task, lease, proposal=proposal, approval=None, object_version=object_version)


def _carried_over(task: Task, proposal: dict, decision) -> ApprovalRequest | None:
    """The approval a re-planned write may carry over instead of asking again (DESIGN.md §7: an
    unchanged, already-authorized low-risk action is not sent for approval twice), or None.

    Only under ``reducer/2``, for a tool the policy rates low-risk, after the task's previous
    approval was granted and then invalidated by a conflict (412: the ticket moved on). The new
    proposal must be the same tool on the same ticket with the same parameters except
    ``if_match``, under the same policy version; the old approval must be unexpired and its
    approver must still hold an allowed role."""

    previous = task.state.get("approval")
    if not (_v2(task) and decision.risk == "low" and previous and previous["status"] == "INVALIDATED"
            and previous.get("reason") == reducer_v2.CONFLICT_REASON):
        return None
    old = (ApprovalRequest.objects.for_tenant(task.tenant_id).select_related("decided_by")
           .filter(pk=previous["id"], decided_by__isnull=False).first())
    if old is None or old.tool != proposal["tool"] or old.policy_version != decision.policy_version:
        return None

    def material(params: dict) -> dict:
        return {k: v for k, v in params.items() if k != "if_match"}

    if material(old.params) != material(proposal["params"]) or old.expires_at <= timezone.now():
        return None
    approver = principal_current(user_id=old.decided_by_id, tenant_id=task.tenant_id)
    if approver is None or approver.role not in (old.approver_roles or ("approver", "admin")):
        return None
    return old


def _v2(task: Task) -> bool:
    """Is the task pinned to ``reducer/2`` or later (comments on an open ticket, conflicts,
    compensation)? A ``reducer/1`` task keeps ``reducer/1``'s plan: always a new ticket."""
    return (task.artifact_bundle or {}).get("reducer") in reducer.V2_PLAN


def _v3(task: Task) -> bool:
    """Is the task pinned to ``reducer/3`` (the budget ledger and recorded model calls)?"""
    return (task.artifact_bundle or {}).get("reducer") == reducer_v3.VERSION


def _plan(state: dict, draft: dict) -> dict:
    """The write the draft leads to, as a proposal ``{tool, tool_version, params, digest}``: a
    comment on the device's open ticket when the plan read one (``reducer/2``), conditional on
    the version read; otherwise a new ticket. Pure: the same state and draft, the same proposal."""
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
    digest = action_digest(tool=tool.name, tool_version=tool.version, params=params)
    return {"tool": tool.name, "tool_version": tool.version, "params": params, "digest": digest}


def _invalidating(approval: ApprovalRequest, reason: str):
    """A ``side_effects`` callback that marks ``approval`` invalidated in the event's transaction."""
    def apply(task: Task, event) -> None:
        approval_invalidate(approval=approval, reason=reason)

    return apply


def _resume_after_approval(task: Task, lease: Lease) -> bool:
    """WAITING_APPROVAL: when the approval is granted, re-check the premises (device version,
    binding, expiry, approver's role) and commit the intent; otherwise invalidate and re-plan."""
    state, gen, actor = task.state, lease.generation, _actor(lease)
    approval, moved = _granted(task, lease, state["approval"])
    if approval is None:
        return moved
    a = state["approval"]
    changed = _premises_changed(task)
    if changed == "requester_revoked":
        task_append_event(task=task, event_type="task.failed", actor=actor, lease_generation=gen,
                          payload={"reason": REQUESTER_GONE})
        return False
    if changed:
        task_append_event(task=task, event_type="approval.invalidated", actor=actor, lease_generation=gen,
                          payload={"approval_id": a["id"], "reason": changed},
                          side_effects=_invalidating(approval, changed))
        return True
    if _invalidated_unless_bound(task, lease, approval, proposal_digest(state["proposal"])):
        return True
    return _commit_intent(task, lease, proposal=state["proposal"], approval=approval,
                          object_version=approval.object_version)


def _granted(task: Task, lease: Lease, a: dict) -> tuple[ApprovalRequest | None, bool]:
    """The state's approval ``a`` (the task's or its compensation's): ``(row, False)`` when it is
    granted and the caller re-checks it; ``(None, True)`` after recording that it expired
    undecided (the next step re-plans); ``(None, False)`` while it is pending, rejected or gone."""
    approval = ApprovalRequest.objects.for_tenant(task.tenant_id).filter(pk=a["id"]).first()
    if approval is None:
        return None, False
    if a["status"] == "PENDING":
        expires = parse_datetime(a["expires_at"])
        if expires is not None and expires <= timezone.now() and approval.status == "PENDING":
            # The approval row changes in the event's own transaction, so a refused event
            # (lease lost) is still recorded and the row is left as it was.
            task_append_event(task=task, event_type="approval.invalidated", actor=_actor(lease),
                              lease_generation=lease.generation, payload={"approval_id": a["id"], "reason": "expired"},
                              side_effects=_invalidating(approval, "approval expired before a decision"))
            return None, True
        return None, False
    return (approval, False) if a["status"] == "APPROVED" else (None, False)


def _invalidated_unless_bound(task: Task, lease: Lease, approval: ApprovalRequest, digest: str) -> bool:
    """Re-check a granted approval's binding now (h(a), object version, expiry, the approver's
    role); when it no longer holds, record ``approval.invalidated`` with the reason and return True.
    ``digest`` is h(a) recomputed from the parameters about to be committed
    (:func:`~apps.actions.digest.proposal_digest`), never a stored digest."""
    check = approval_check_binding_now(approval=approval, action_digest=digest)
    if check.ok:
        return False
    task_append_event(task=task, event_type="approval.invalidated", actor=_actor(lease),
                      lease_generation=lease.generation,
                      payload={"approval_id": str(approval.pk), "reason": check.reason},
                      side_effects=_invalidating(approval, check.reason))
    return True


def _commit_intent(task: Task, lease: Lease, *, proposal: dict, approval: ApprovalRequest | None,
                   object_version: int, compensates: Action | None = None) -> bool:
    """DESIGN.md §1 step 6: in ONE transaction — CAS on task version + fencing token, budget
    reservation (checked by δ: U + R + r ≤ B), the action identity with its idempotency key, the
    intent event and the outbox row. The dispatcher is kicked on commit. Parameters that do not
    match the tool's schema, or a reused key, are refused before any row is written; parameters
    whose recomputed h(a) is not the approval's invalidate it (the task asks again).
    ``compensates``: the action whose effect this one compensates (``reducer/2``). Returns True
    when the agent should take another step now (the approval was invalidated)."""
    from apps.outbox.tasks import enqueue_dispatch

    tool = tool_get(proposal["tool"])
    if short := _write_short(task, tool):
        task_append_event(task=task, event_type="compensation.failed" if compensates is not None else "task.failed",
                          actor=_actor(lease), lease_generation=lease.generation, payload={"reason": short})
        return False
    if compensates is None and _requester_gone(task):
        # Also where no approval was needed: the person the ticket is filed for must still be one.
        task_append_event(task=task, event_type="task.failed", actor=_actor(lease), lease_generation=lease.generation,
                          payload={"reason": REQUESTER_GONE})
        return False
    try:
        params_validate(tool.name, proposal["params"])
    except ParamsInvalid as exc:
        refused_event_record(task=task, event_type="intent.committed", payload={"digest": proposal["digest"]},
                             reason=str(exc), actor=_actor(lease), lease_generation=lease.generation)
        event = "compensation.failed" if compensates is not None else "task.failed"
        task_append_event(task=task, event_type=event, actor=_actor(lease), lease_generation=lease.generation,
                          payload={"reason": f"invalid parameters: {exc}"})
        return False
    # h(a) of what is committed now — the tool at its current version, the parameters as they
    # are — recomputed: a stored digest is only a label that may have been left behind.
    digest = action_digest(tool=tool.name, tool_version=tool.version, params=proposal["params"])
    if approval is not None and digest != approval.action_digest:
        reason = "the parameters to commit differ from the approved ones (h(a) recomputed at the intent)"
        refused_event_record(task=task, event_type="intent.committed", payload={"digest": digest}, reason=reason,
                             actor=_actor(lease), lease_generation=lease.generation)
        task_append_event(task=task, event_type="approval.invalidated", actor=_actor(lease),
                          lease_generation=lease.generation,
                          payload={"approval_id": str(approval.pk), "reason": reason},
                          side_effects=_invalidating(approval, reason))
        return True
    # The ticket system this action goes to, fixed now (a compensation: where its ticket is). The
    # approval's effects name the system it was asked for: another one is not what was approved.
    connector = compensates.connector if compensates is not None else task.tenant.ticket_system
    if approval is not None and f"in {CONNECTORS[connector].label}" not in approval.side_effects:
        reason = f"the ticket system changed since approval (now {CONNECTORS[connector].label})"
        task_append_event(task=task, event_type="approval.invalidated", actor=_actor(lease),
                          lease_generation=lease.generation,
                          payload={"approval_id": str(approval.pk), "reason": reason},
                          side_effects=_invalidating(approval, reason))
        return True
    action_id = uuid.uuid4()
    key = idempotency_key(tenant_slug=task.tenant.slug, tool=tool.name, task_id=str(task.pk),
                          digest=digest, intent_seq=task.version + 1)
    reused = Action.objects.for_tenant(task.tenant_id).filter(idempotency_key=key).first()
    if reused is not None:
        # One key, one logical action: a key already bound to other parameters (or to another
        # action) is refused before any action or outbox row is written.
        reason = (f"idempotency key {key} is already bound to action {reused.pk} "
                  f"({'other parameters' if reused.params_digest != digest else 'the same parameters'})")
        refused_event_record(task=task, event_type="intent.committed", payload={"idempotency_key": key,
                             "digest": digest}, reason=reason, actor=_actor(lease),
                             lease_generation=lease.generation)
        event = "compensation.failed" if compensates is not None else "task.failed"
        task_append_event(task=task, event_type=event, actor=_actor(lease), lease_generation=lease.generation,
                          payload={"reason": "idempotency key reused: the intent was refused"})
        return False
    params = proposal["params"]
    ordering_key = f"ticket:{connector}:{params['ticket_id']}" if tool.object_scope == "ticket" \
        else f"{tool.name}:{key}"

    def write_action(t: Task, event) -> None:
        action = Action.objects.create(
            id=action_id, tenant_id=t.tenant_id, task_id=t.pk, tool=tool.name, tool_version=tool.version,
            connector=connector, params=params, params_digest=digest, idempotency_key=key,
            approval=approval, object_version=object_version, reservation=tool.cost_units, compensates=compensates,
        )
        OutboxMessage.objects.create(
            tenant_id=t.tenant_id, action=action, ordering_key=ordering_key, available_at=timezone.now(),
        )
        transaction.on_commit(enqueue_dispatch)

    task_append_event(
        task=task, event_type="intent.committed", actor=_actor(lease), lease_generation=lease.generation,
        payload={"action_id": str(action_id), "idempotency_key": key, "digest": digest,
                 "reservation": tool.cost_units, "approval_required": approval is not None,
                 "approval_id": str(approval.pk) if approval else None,
                 "proposal": proposal if approval is None else None, "object_version": object_version,
                 "connector": connector},
        side_effects=write_action,
    )
    return False


# --- compensation (reducer/2; DESIGN.md §6 "saga"; spec table 16.5 "取消后收到回执") ----------------

COMPENSATION_REASON = "the request was cancelled after its ticket was created"


def _canceller_id(task: Task) -> int:
    """The user who asked for the cancel that this compensation follows (the actor of the task's
    last ``cancel.requested``, a member of its tenant) — the one who "asked" for the compensation,
    so that person cannot approve it; the requester when it cannot be told."""
    cancel = (TaskEvent.objects.for_tenant(task.tenant_id).filter(task_id=task.pk, type="cancel.requested")
              .order_by("-seq").values_list("actor", flat=True).first()) or ""
    if cancel.startswith("user:"):
        member = (Membership.objects.for_tenant(task.tenant_id).filter(user__username=cancel[len("user:"):])
                  .values_list("user_id", flat=True).first())
        if member is not None:
            return member
    return task.requester_id


def _compensation_due(task: Task) -> bool:
    """A cancelled ``reducer/2`` task whose ticket was created anyway (a late receipt, or a receipt
    just before the cancel) and whose compensation was not asked for yet. A comment is not
    compensated: it cannot be taken back, and it created nothing."""
    state = task.state
    receipt = state.get("receipt")
    return _v2(task) and state.get("compensation") is None and receipt is not None \
        and receipt.get("kind", "ticket") == "ticket"


def _created_ticket(receipt: dict) -> dict:
    return {"connector": receipt.get("connector", "reference"), "external_id": receipt["external_id"],
            "version": int(receipt["version"]), "status": receipt.get("status"), "priority": None, "title": ""}


def _compensation_request(task: Task, lease: Lease, *, ticket: dict) -> bool:
    """Ask to close ``ticket`` (as read) as a new ``ticket.update`` action with its own approval,
    conditional on the version read. A ticket system without conditional writes cannot do it
    safely: the compensation then waits for a person at once."""
    gen, actor, state = lease.generation, _actor(lease), task.state
    connector = ticket["connector"]
    base = {"reason": COMPENSATION_REASON, "ticket": ticket, "requested_at": timezone.now().isoformat()}
    if not CONNECTORS[connector].supports_conditional_writes:
        task_append_event(task=task, event_type="compensation.requested", actor=actor, lease_generation=gen,
                          payload={**base, "outcome": "needs_person",
                                   "note": f"{CONNECTORS[connector].label} has no conditional update: close ticket "
                                           f"{ticket['external_id']} there by hand, then record it here"})
        return False
    others = _other_reports_on(task, ticket)
    if others:
        # Closing it would bury another request's live report: the ticket stays open.
        task_append_event(task=task, event_type="compensation.requested", actor=actor, lease_generation=gen,
                          payload={**base, "outcome": "not_needed", "by": actor,
                                   "note": f"ticket {ticket['external_id']} also carries the reports of "
                                           f"{len(others)} other request(s) ({', '.join(others[:5])}); it stays open"})
        return False
    tool = tool_get("ticket.update")
    params = {"ticket_id": ticket["external_id"], "if_match": ticket["version"], "reason": COMPENSATION_REASON,
              "changes": {"status": "closed",
                          "comment": f"Closed by faultdesk: {COMPENSATION_REASON} (task {task.pk})."}}
    digest = action_digest(tool=tool.name, tool_version=tool.version, params=params)
    proposal = {"tool": tool.name, "tool_version": tool.version, "params": params, "digest": digest}
    decision = policy_decide(tenant_id=task.tenant_id, tool=tool.name)  # approval needed whatever it says
    approval_id, expires_at = uuid.uuid4(), timezone.now() + decision.ttl

    def create_approval(t: Task, event) -> None:
        ApprovalRequest.objects.create(
            id=approval_id, tenant_id=t.tenant_id, task_id=t.pk, requested_by_id=_canceller_id(t), tool=tool.name,
            tool_version=tool.version, params=params, action_digest=digest, object_type="ticket",
            object_id=ticket["external_id"], object_version=ticket["version"], policy_version=decision.policy_version,
            approver_roles=list(decision.approver_roles),
            scope=f"{t.tenant.slug}:{tool.name}:ticket/{ticket['external_id']}",
            side_effects=f"Compensation: closes ticket {ticket['external_id']} in {CONNECTORS[connector].label}, "
                         f"which was created although the request was cancelled; only while the ticket is still "
                         f"at version {ticket['version']} (If-Match). Rejecting leaves the ticket open.",
            evidence=state.get("evidence") or [], expires_at=expires_at,
        )

    task_append_event(task=task, event_type="compensation.requested", actor=actor, lease_generation=gen,
                      payload={**base, "proposal": proposal, "approval_id": str(approval_id),
                               "policy_version": decision.policy_version, "expires_at": expires_at.isoformat()},
                      side_effects=create_approval)
    return False


def _other_reports_on(task: Task, ticket: dict) -> list[str]:
    """Ids of other tasks whose comments on ``ticket`` were written or may still be (anything but
    not sent / failed): their requesters were told their report is on that ticket."""
    from apps.actions.models import ActionStatus

    rows = (Action.objects.for_tenant(task.tenant_id)
            .filter(tool="ticket.comment", connector=ticket["connector"], params__ticket_id=ticket["external_id"])
            .exclude(task_id=task.pk).exclude(status__in=[ActionStatus.NOT_SENT, ActionStatus.FAILED])
            .values_list("task_id", flat=True).distinct())
    return sorted(str(t) for t in rows)


def _compensate(task: Task, lease: Lease) -> bool:
    """COMPENSATING: re-plan (re-read the ticket), or act on the compensation's approval."""
    gen, actor, state = lease.generation, _actor(lease), task.state
    c = state["compensation"]
    if c["status"] == reducer_v2.C_REPLANNING:
        limit = settings.FAULTDESK["MAX_COMPENSATION_REPLANS"]
        if c["conflicts"] + c["replans"] >= limit:
            task_append_event(task=task, event_type="compensation.failed", actor=actor, lease_generation=gen,
                              payload={"reason": f"gave up after {c['conflicts']} conflicts and {c['replans']} "
                                                 f"re-plans (limit {limit}): the ticket keeps changing"})
            return False
        try:
            current = connector_for("ticket.update", c["ticket"]["connector"]).get_ticket(
                external_id=c["ticket"]["external_id"])
        except errors.ToolError as exc:
            started = parse_datetime(c.get("started_at") or "") or task.updated_at
            window = timedelta(seconds=settings.FAULTDESK["TASK_DEADLINE_SECONDS"])
            if timezone.now() - started > window:
                task_append_event(task=task, event_type="compensation.failed", actor=actor, lease_generation=gen,
                                  payload={"reason": f"the ticket system could not be read within "
                                                     f"{int(window.total_seconds())} s of the compensation's "
                                                     f"start ({exc.code})"})
                return False
            log.info("compensation of %s: the ticket cannot be read now (%s)", task.pk, exc)
            return False  # the sweeper brings the task back
        if current is None or current.get("status") in ("resolved", "closed"):
            note = "the ticket no longer exists" if current is None else f"the ticket is already {current['status']}"
            task_append_event(task=task, event_type="compensation.resolved", actor=actor, lease_generation=gen,
                              payload={"outcome": "not_needed", "by": actor, "note": note})
            return False
        return _compensation_request(task, lease, ticket=ticket_snapshot(current, c["ticket"]["connector"]))
    if c["status"] != reducer_v2.C_WAITING_APPROVAL or c.get("approval") is None:
        return False  # DISPATCHING: the outbox acts
    approval, moved = _granted(task, lease, c["approval"])
    if approval is None:
        return moved
    if _invalidated_unless_bound(task, lease, approval, proposal_digest(c["proposal"])):
        return True
    b, cost = state["budget"], tool_get(c["proposal"]["tool"]).cost_units
    if b["used"] + b["reserved"] + cost > b["total"]:
        task_append_event(task=task, event_type="compensation.failed", actor=actor, lease_generation=gen,
                          payload={"reason": f"budget: U+R+r = {b['used']}+{b['reserved']}+{cost} exceeds "
                                             f"B={b['total']}"})
        return False
    original = Action.objects.for_tenant(task.tenant_id).get(pk=state["action"]["id"])
    return _commit_intent(task, lease, proposal=c["proposal"], approval=approval,
                          object_version=c["ticket"]["version"], compensates=original)
