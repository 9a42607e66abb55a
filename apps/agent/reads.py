"""The context reads under one plan version (``reducer/6``; long-task-runtime.md: ready / join; spec
§16.5 for their reservations and deadlines; docs/adr/0023).

Three reads — the device, its open ticket, retrieval — each with its own reservation, deadline and
premise judgement. Only a read that calls out of the process (``READS_AS_ACTIVITIES``, by default the
open-ticket read at the ticket system) is an activity of its own on the ``tools`` queue; the local
ones (a device row; retrieval: in-process embedding and SQL) the dispatching run does itself:

1. **Dispatch** (:func:`reads_step`, the ``RETRIEVING`` step, under the task's lease): activate a plan
   version when there is none or a re-plan is due (:func:`apps.agent.plans.plan_activate`), then for
   each read still pending record its reservation — one tool call, a deadline-bounded timeout, the
   step and the plan version, not bound to the lease. The remote reads' messages leave at the commit
   of those reservations (the run's checkpoint), before the local reads start.
2. **Read** (:func:`read_perform`, no transaction): one read, with the premises it worked under
   (those its plan dispatched it with, overlaid with what it observed: the device's version and
   profile, the requester's scopes, the report) — on a ``tools`` worker without the lease for a
   remote read, in the dispatching run (:func:`local_reads_run`, outside its transaction) for a
   local one.
3. **Report** (:func:`read_record`, under the lease — the dispatching run's, or the one the activity
   then claims): judged by premise against the current plan version
   (:func:`apps.tasks.reducer.v6.verdict`): accepted, re-validated (:func:`revalidate`) or refused; a
   read of the current version that found a premise moved on first activates the next version. The
   read's event settles its reservation at the calls made. When the last read joins, the task
   proposes, in the same run.

A read whose worker died lapses at its deadline: the next dispatch charges its reservation (``c = r``)
and reads again. A read that failed (the ticket system cannot be read now, or a local read raised) is
read again by the next run: the remote read's report, or the one the sweeper brings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.accounts.principal import principal_current
from apps.agent.common import actor_of, deadline_reason, fail
from apps.agent.context import input_flags
from apps.agent.intent import joined_ticket_pending
from apps.agent.plans import device_profile, digest_of, evidence_status, plan_activate, premises_now, report_text
from apps.core import tool_errors as errors
from apps.core.queue import READ_STEP, enqueue_on_commit
from apps.devices.selectors import device_read
from apps.evidence.guard import refs_flags
from apps.evidence.relevance import evidence_select
from apps.tasks import reducer
from apps.tasks.budget import activity_timeout, budget_reserve, budget_settle
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v6
from apps.tasks.runs import checkpoint, run_current_task
from apps.tasks.store import task_append_event
from apps.tasks.usage import BudgetExceeded
from apps.tickets.selectors import open_ticket_read

log = logging.getLogger(__name__)


def reads_step(task: Task, lease: Lease) -> bool:
    """``RETRIEVING`` under ``reducer/6``: activate the plan version if due, charge the reads that
    lapsed, reserve every read still pending (:data:`v6.READS` order), send the remote ones
    (:func:`remote_reads`) to the ``tools`` queue at the commit, then do the local ones here, outside
    any transaction, and report each under this run's lease (:func:`local_reads_run`). Returns True
    when the task moved on (every read of the version joined), False when it waits for a read (or
    failed, or a local read failed: the sweeper brings it back)."""
    if joined_ticket_pending(task):
        return False  # one ticket per fault: another report's ticket for this device is still being created
    task = plan_if_due(task, lease)
    if task.status != reducer.RETRIEVING:
        return True
    task = _lapsed_charge(task, lease)
    pending = [step for step in v6.READS if (task.state["steps"].get(step) or {}).get("status") == "pending"]
    if not pending:
        return False
    timeout = activity_timeout(task, wanted=settings.FAULTDESK["REFSERVICE_TIMEOUT_SECONDS"])
    if timeout is None:
        fail(task, lease, deadline_reason(task))
        return False
    plan = v6.current_plan(task.state)
    deadline = (timezone.now() + timedelta(seconds=timeout)).isoformat()
    remote, local = remote_reads(), []
    for step in pending:
        try:
            task, reservation = budget_reserve(
                task_id=task.pk, activity=f"read:{step}", amounts={"tool_calls": 1}, actor=actor_of(lease),
                lease_generation=lease.generation, timeout_s=timeout, task=task, bound_to_lease=False,
                extra={"step": step, "plan_version": plan["version"], "deadline": deadline})
        except BudgetExceeded as exc:
            fail(task, lease, exc.reason)
            return False
        if step in remote:
            enqueue_on_commit(READ_STEP, task.pk, reservation.id)
        else:
            local.append(reservation.id)
    if not local:
        return False
    task, go_on = local_reads_run(task, lease, local)
    # on when the join is complete, or when a report made a read pending again (refused, cancelled by
    # a re-plan): the next step reserves it again (MAX_STEPS_PER_RUN bounds the run)
    return go_on and (task.status != reducer.RETRIEVING or any(
        (st or {}).get("status") == "pending" for st in task.state["steps"].values()))


def remote_reads() -> frozenset[str]:
    """The reads sent to the ``tools`` queue as activities of their own (``READS_AS_ACTIVITIES``:
    those that call out of the process, by default the open-ticket read); the others are local."""
    return frozenset(settings.FAULTDESK.get("READS_AS_ACTIVITIES", ("ticket",))) & frozenset(v6.READS)


def local_reads_run(task: Task, lease: Lease, activity_ids: list[str]) -> tuple[Task, bool]:
    """Do the local reads ``activity_ids`` (reserved by this run, under ``lease``) of ``task``: the
    run's events so far commit first (:func:`~apps.tasks.runs.checkpoint` — the remote reads'
    messages leave at that commit, before these reads start), the reads run one after the other
    outside any transaction, then each is reported through :func:`read_record` — the same premise
    judgement, events and settlement as an activity's report — in the run's next transaction. A
    read that raises is recorded as ``read.failed`` at its cost (one call), logged, and not raised.
    Returns ``(task, go_on)``: ``go_on`` False when a report stopped the run (a failed read, a
    device gone)."""
    activities = task.state["activities"]
    outcomes = []
    with checkpoint():
        for aid in activity_ids:
            act = activities[aid]
            try:
                outcomes.append((aid, read_perform(task, act, timeout=task.state["reservations"][aid]["timeout_s"])))
            except Exception as exc:  # noqa: BLE001 - recorded as a failed read at its cost; the sweeper reads again
                log.exception("the %s read of task %s raised", act["step"], task.pk)
                outcomes.append((aid, ReadOutcome(step=act["step"], premises=act["premises"], made=1,
                                                  error=f"the read raised {exc!r}"[:500])))
    go_on = True
    for aid, outcome in outcomes:
        task = run_current_task(task.pk, lease.generation) or _reread(task)
        task, ok = read_record(task, lease, aid, outcome)
        go_on = go_on and ok
        if task.status in reducer.TERMINAL:
            break
    return task, go_on


def _reread(task: Task) -> Task:
    """``task`` as its row stands now, keeping the tenant, requester and device already read."""
    now = Task.objects.get(pk=task.pk)
    now.tenant, now.requester, now.device = task.tenant, task.requester, task.device
    return now


def plan_if_due(task: Task, lease: Lease) -> Task:
    """Activate the first plan version, or the next one when a re-plan is due (``replan_due``)."""
    state = task.state
    if state.get("plans") and not state.get("replan_due"):
        return task
    if not state.get("plans"):
        return plan_activate(task, lease, why="first plan", reason="the report was accepted")
    due = state["replan_due"]
    return plan_activate(task, lease, why=f"{due['event']}: {due['reason']}", reason=due["reason"])


def _lapsed_charge(task: Task, lease: Lease) -> Task:
    """Charge at its reservation (``c = r``: what it did is unknown) each read of the task that has not
    reported by its deadline plus the clean-up time; ``reducer/6`` then reads it again."""
    grace = timedelta(seconds=settings.FAULTDESK["ACTIVITY_CLEANUP_SECONDS"])
    now = timezone.now()
    for step in v6.READS:
        st = task.state["steps"].get(step) or {}
        if st.get("status") != "dispatched":
            continue
        aid = st["activity_id"]
        deadline = parse_datetime(task.state["activities"][aid].get("deadline") or "")
        if deadline is None or deadline + grace > now or aid not in task.state["reservations"]:
            continue
        task = budget_settle(task_id=task.pk, reservation_id=aid, actor=actor_of(lease),
                             lease_generation=lease.generation, task=task,
                             used=task.state["reservations"][aid]["amounts"],
                             extra={"unknown_outcome": True,
                                    "reason": f"the {step} read did not report by its deadline: charged at its "
                                              "reservation, read again"})
    return task


# --- the read, outside any transaction -----------------------------------------------------------

@dataclass
class ReadOutcome:
    """What one read found: the event payload it reports by (``payload``), the premises it worked
    under (``premises``), the calls it made (``made``), or the ``error`` that stopped it."""

    step: str
    premises: dict
    payload: dict = field(default_factory=dict)
    made: int = 0
    error: str | None = None


def read_perform(task: Task, activity: dict, *, timeout: float | None) -> ReadOutcome:
    """Do the read ``activity`` (an entry of the task's ``activities``) of ``task`` with
    ``timeout`` seconds: no lease, no transaction. A ticket system that cannot be read is an
    ``error`` (read again later); every other exception is raised."""
    step, premises = activity["step"], dict(activity["premises"])
    out = ReadOutcome(step=step, premises=premises, made=1)
    if step == "device":
        reading = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
        premises.update(device_version=reading["version"] if reading else None, device_profile=device_profile(reading))
        out.payload = {"reading": reading, "read_at": timezone.now().isoformat()}
    elif step == "ticket":
        try:
            ticket = open_ticket_read(tenant_id=task.tenant_id, device_id=task.device_id,
                                      connector=task.tenant.ticket_system, timeout=timeout)
        except errors.ToolError as exc:
            out.error = f"the ticket system cannot be read now: {exc}"[:500]
            return out
        out.payload = {"ticket": ticket, "read_at": timezone.now().isoformat()}
    else:
        principal = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
        scopes = sorted(principal.scopes) if principal else []
        reading = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
        report = report_text(task)
        premises.update(device_version=reading["version"] if reading else None,
                        device_profile=device_profile(reading), scopes=scopes, request=digest_of(report))
        selection = evidence_select(tenant_id=task.tenant_id, scopes=scopes, report=report, device=reading,
                                    k=settings.FAULTDESK["RETRIEVAL_TOP_K"],
                                    model=task.artifact_bundle.get("embedding_model"))
        refs, chosen = selection.recorded()
        payload = {"query": report, "refs": refs, "selection": chosen, "retrieved_at": timezone.now().isoformat()}
        state = task.state or {}
        flagged = refs_flags(refs) + input_flags(report=task.symptom, answers=state.get("answers", []),
                                                 reading=reading,
                                                 attachments=(state.get("request") or {}).get("attachments") or [])
        if flagged:
            payload["injection_flags"] = flagged  # shown on the trace and queue; nothing else changes
            chosen["injection_flags"] = flagged
        out.payload = payload
    return out


# --- the report, under the lease ----------------------------------------------------------------------

def activity_open(state: dict, activity_id: str) -> dict | None:
    """The read activity ``activity_id`` of a task's ``state`` while it may still read and report —
    ``dispatched`` with its reservation open, or ``lapsed`` (charged at its reservation: judged by
    premise if it reports after all) — else None: unknown, reported, or closed (settled ``unjoined``;
    in a log from before that mark, a ``dispatched`` read whose reservation was settled or released
    is closed too). A duplicate ``read_step`` message finds it None and neither reads nor reports."""
    act = (state.get("activities") or {}).get(activity_id)
    if act is None or act["status"] not in ("dispatched", "lapsed"):
        return None
    if act["status"] == "dispatched" and activity_id not in (state.get("reservations") or {}):
        return None
    return act


def read_record(task: Task, lease: Lease, activity_id: str, outcome: ReadOutcome | None) -> tuple[Task, bool]:
    """Report the read ``activity_id`` of ``task`` (read under ``lease``) with ``outcome`` (None:
    the task was cancelled or ended before it read). Returns ``(task, go_on)``: ``go_on`` when the
    run may take the task's next steps now (False after a failed read: the sweeper brings it back)."""
    gen, actor = lease.generation, actor_of(lease)
    state = task.state
    act = activity_open(state, activity_id)
    if act is None:
        return task, True  # reported already, or closed: a duplicate message
    used = {"used": {"tool_calls": outcome.made if outcome else 0}} if activity_id in state["reservations"] else {}
    step = act["step"]
    base = {"activity_id": activity_id, "plan_version": act["plan_version"], **used}
    if task.status != reducer.RETRIEVING or (state["steps"].get(step) or {}).get("status") == "joined" \
            or outcome is None:
        # nothing left to join it to (the task moved on, or another read of this step joined first):
        # only its cost is recorded
        if used:
            task = budget_settle(task_id=task.pk, reservation_id=activity_id, used=used["used"], actor=actor,
                                 lease_generation=gen, task=task,
                                 extra={"unjoined": True,
                                        "reason": f"the {step} read reported when nothing waited for it"})
        return task, True
    if outcome.error is not None:
        task = task_append_event(task=task, event_type="read.failed", actor=actor, lease_generation=gen,
                                 payload={**base, "error": outcome.error})
        return task, False
    task = plan_if_due(task, lease)
    plan = v6.current_plan(task.state)
    if act["plan_version"] == plan["version"]:
        # a premise the read observes itself (v6.OBSERVES) that moved on: the next version first
        moved = [k for k in v6.OBSERVES[step] if outcome.premises[k] != plan["premises"][k]
                 and not _older_device(k, outcome.premises[k], plan["premises"][k])]
        if moved:
            task = plan_activate(task, lease, why=f"the {step} read found premises moved on: {', '.join(moved)}",
                                 premises=premises_now(task))
            plan = v6.current_plan(task.state)
    refs = [r["chunk_id"] for r in outcome.payload.get("refs") or []] if step == "retrieval" else None
    verdict, changed = v6.verdict(step, outcome.premises, plan["premises"], refs)
    payload = {**base, **outcome.payload, "premises": outcome.premises, "verdict": verdict}
    if verdict == v6.REVALIDATED:
        check = revalidate(task, step, outcome)
        payload["revalidation"] = check
        if not check["ok"]:
            task = task_append_event(task=task, event_type="result.refused", actor=actor, lease_generation=gen,
                                     payload={**base, "premises": outcome.premises, "revalidation": check,
                                              "reason": f"re-validation failed after {', '.join(changed)} changed: "
                                                        f"{check['why']}"})
            return task, True
    elif verdict == v6.REFUSED:
        task = task_append_event(task=task, event_type="result.refused", actor=actor, lease_generation=gen,
                                 payload={**base, "premises": outcome.premises,
                                          "reason": f"premises it depends on changed: {', '.join(changed)}"})
        return task, True
    task = task_append_event(task=task, event_type=v6.READ_EVENT[step], actor=actor, lease_generation=gen,
                             payload=payload)
    if step == "device" and outcome.payload.get("reading") is None:
        return fail(task, lease, "device no longer exists in the tenant"), False
    return task, True


def _older_device(key: str, observed, planned) -> bool:
    """A device version read before the plan's own: old news, judged, never a reason to re-plan."""
    return key == "device_version" and isinstance(observed, int) and isinstance(planned, int) and observed < planned


def revalidate(task: Task, step: str, outcome: ReadOutcome) -> dict:
    """Check a result whose non-decisive premises changed against the world now:
    ``{"ok": bool, "checked": str, "why": str}``. The device reading must still be the device's
    version; every chunk retrieval returned must still be current and readable by the requester;
    an open ticket's version is checked by the ticket system itself at the write (If-Match)."""
    if step == "device":
        reading = outcome.payload.get("reading")
        now = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
        same = (reading or {}).get("version") == (now or {}).get("version")
        return {"ok": same, "checked": "the device's object version",
                "why": "" if same else f"the device is at v{(now or {}).get('version')} now"}
    if step == "retrieval":
        status = evidence_status(task, outcome.payload.get("refs")) or {}
        moved = {c: s for c, s in status.items() if s != "current"}
        return {"ok": not moved, "checked": "every chunk retrieved is current and readable by the requester",
                "why": ", ".join(f"chunk {c} {s}" for c, s in sorted(moved.items()))}
    return {"ok": True, "checked": "a comment is conditional on the version read (If-Match): a moved ticket "
                                   "answers 412 and re-plans", "why": ""}
