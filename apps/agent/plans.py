"""Plan versions and their premises (long-task-runtime.md: PlanVersion, Replan Barrier; ``reducer/6``,
docs/adr/0022): what a plan is based on, read from the world now, and the barrier that activates the
next version — which reads continue (their results depend on no premise that changed) and which are
cancelled and done again.

The premises (:data:`apps.tasks.reducer.v6.PREMISES`) are JSON values:

* ``request`` — a digest of what the requester reported (the symptom, the answers since, the text of
  the attached logs): new material changes it;
* ``scopes``, ``requester_role`` — the requester's permissions now;
* ``device_version``, ``device_profile`` — the device's object version, and the fields retrieval
  filters on (kind, alert code, alert message);
* ``policy_version``, ``bundle`` — the tenant's approval policy and the task's artifact bundle;
* ``approver_role`` — the role the approver of the task's granted approval holds now (None before);
* ``ticket_epoch`` — how many times the task learned that the device's open ticket moved on (a
  conflict) or was being created by another report (a deferred intent): a ticket read from before
  is stale;
* ``evidence`` — ``{chunk_id: "current" | "superseded" | "retired" | "unreadable"}`` of the evidence the
  plan carries from before (None for a plan that retrieves afresh).
"""

from __future__ import annotations

import hashlib
import json

from apps.accounts.principal import principal_current
from apps.agent.common import actor_of
from apps.approvals.models import ApprovalRequest
from apps.approvals.policy import policy_current
from apps.devices.selectors import device_read
from apps.evidence.selectors import chunks_status
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.reducer import v6
from apps.tasks.store import task_append_event


def digest_of(value) -> str:
    """A short stable digest (16 hex characters) of a JSON value."""
    raw = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def report_text(task: Task) -> str:
    """What the requester reported: the symptom, the answers given since and the fault lines of the
    logs attached to the report (request data, like the symptom: retrieval searches with them, the
    model sees them inside ``<attachment>`` tags; the device's alert is matched separately, so it
    cannot drown the report; apps.evidence.relevance)."""
    state = task.state or {}
    logs = [a.get("text") or "" for a in ((state.get("request") or {}).get("attachments") or [])]
    return " ".join(p for p in [task.symptom, *state.get("answers", []), *logs] if p)


def device_profile(reading: dict | None) -> dict | None:
    """The fields of a device reading retrieval filters on, or None without a device."""
    if reading is None:
        return None
    return {k: reading.get(k) or "" for k in ("kind", "alert_code", "alert_message")}


def premises_now(task: Task, *, reading: dict | None = None, read_device: bool = True) -> dict:
    """The premises of ``task`` as the world stands now (a dict over every key of
    :data:`~apps.tasks.reducer.v6.PREMISES`). ``reading``: a device reading just taken (else the
    device is read here, unless ``read_device`` is False). Reads the database only."""
    state = task.state or {}
    principal = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    if reading is None and read_device:
        reading = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
    return {
        "request": digest_of(report_text(task)),
        "scopes": sorted(principal.scopes) if principal else [],
        "requester_role": principal.role if principal else None,
        "device_version": reading["version"] if reading else None,
        "device_profile": device_profile(reading),
        "policy_version": policy_current(tenant_id=task.tenant_id).version,
        "bundle": digest_of(task.artifact_bundle or {}),
        "approver_role": _approver_role(task),
        "ticket_epoch": state.get("ticket_epoch", 0),
        "evidence": evidence_status(task, _carried_refs(state)),
    }


def _carried_refs(state: dict) -> list[dict] | None:
    """The evidence refs the next plan may carry: joined now, or kept by a re-plan."""
    if state.get("evidence"):
        return state["evidence"]
    carried = (state.get("carried") or {}).get("retrieval")
    return (carried or {}).get("values", {}).get("evidence") or None


def evidence_status(task: Task, refs: list[dict] | None) -> dict | None:
    """``{chunk_id: status}`` of ``refs`` for the task's requester now: ``current``, ``superseded``
    (its document has a newer version), ``retired`` (its document was withdrawn) or ``unreadable``
    (gone, or outside the requester's scopes). None without refs."""
    if not refs:
        return None
    principal = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    scopes = principal.scopes if principal else ()
    return chunks_status(tenant_id=task.tenant_id, scopes=scopes, chunk_ids=[r["chunk_id"] for r in refs])


def _approver_role(task: Task) -> str | None:
    a = (task.state or {}).get("approval")
    if not a or a.get("status") != "APPROVED":
        return None
    decided_by = (ApprovalRequest.objects.for_tenant(task.tenant_id).filter(pk=a["id"])
                  .values_list("decided_by_id", flat=True).first())
    approver = principal_current(user_id=decided_by, tenant_id=task.tenant_id) if decided_by else None
    return approver.role if approver else "revoked"


def barrier_for(state: dict, premises: dict) -> tuple[dict, list[str]]:
    """``(continuing, cancelled)`` of a re-plan to ``premises``: each read whose result — joined,
    kept by the re-plan, or in flight — depends on no premise that changed
    (:func:`apps.tasks.reducer.v6.verdict` is not ``refused``; for retrieval that includes evidence
    the new version marks superseded, retired or unreadable) continues (``"joined"`` or
    ``"in_flight"``), and a joined retrieval only while its evidence is all current; every other
    step is cancelled. δ refuses a barrier that lets a step continue whose verdict is ``refused``."""
    continuing = {}
    evidence_ok = all(v == "current" for v in (premises.get("evidence") or {}).values())
    for step in v6.READS:
        st = (state.get("steps") or {}).get(step) or {}
        kept = (state.get("carried") or {}).get(step)
        if st.get("status") == "joined":
            how, result = "joined", st["premises"]
        elif kept is not None:
            how, result = "joined", kept["premises"]
        elif st.get("status") == "dispatched":
            how, result = "in_flight", state["activities"][st["activity_id"]]["premises"]
        else:
            continue
        if v6.verdict(step, result, premises)[0] == v6.REFUSED:
            continue
        if step == "retrieval" and how == "joined" and not evidence_ok:
            continue
        continuing[step] = how
    return continuing, [s for s in v6.STEPS if s not in continuing]


def plan_activate(task: Task, lease: Lease, *, why: str, premises: dict | None = None,
                  reason: str = "") -> Task:
    """Record the task's next plan version (``plan.activated``) with ``premises`` (default: read
    now), behind a barrier when it is not the first: ``why`` it re-plans, which reads continue and
    which steps are cancelled (:func:`barrier_for`). Returns the task. Raises what
    :func:`~apps.tasks.store.task_append_event` raises."""
    state = task.state
    premises = premises if premises is not None else premises_now(task)
    plans = state.get("plans") or []
    barrier = None
    if plans:
        continuing, cancelled = barrier_for(state, premises)
        barrier = {"from_version": len(plans), "why": why[:500], "continuing": continuing, "cancelled": cancelled,
                   "changed": v6.changed_premises(plans[-1]["premises"], premises)}
    return task_append_event(task=task, event_type="plan.activated", actor=actor_of(lease),
                             lease_generation=lease.generation,
                             payload={"version": len(plans) + 1, "premises": premises, "steps": list(v6.STEPS),
                                      "reason": (reason or why)[:500], "barrier": barrier})


#: the premises a resume re-checks by a check of their own, before the plan's premises are compared:
#: the approver's role by the approval's binding (:func:`apps.approvals.services.approval_check_binding_now`),
#: the evidence by its readability and its versions (``premises_changed``, :func:`evidence_changed`)
CHECKED_AT_RESUME = ("approver_role", "evidence")


def premises_moved(task: Task, now: dict | None = None) -> list[str]:
    """The premise keys (:data:`~apps.tasks.reducer.v6.PREMISES` order) on which the task's current
    plan version no longer holds: its premises against ``now`` (default :func:`premises_now`), but
    for :data:`CHECKED_AT_RESUME`, which are re-checked on their own. Empty without a plan. Reads
    the database only (long-task-runtime.md: resume re-checks the current premises)."""
    plan = v6.current_plan(task.state or {})
    if plan is None:
        return []
    now = now if now is not None else premises_now(task)
    return [k for k in v6.changed_premises(plan["premises"], now) if k not in CHECKED_AT_RESUME]


def evidence_changed(task: Task) -> str | None:
    """Why the evidence the task's draft was built on no longer stands — a retrieved chunk superseded
    or retired since — or None when it all stands (a chunk the requester may no longer read is a
    change of permissions, which invalidates the approval instead)."""
    status = evidence_status(task, (task.state or {}).get("evidence"))
    moved = {cid: st for cid, st in (status or {}).items() if st in ("superseded", "retired")}
    if not moved:
        return None
    return "evidence changed while the task waited: " + ", ".join(f"chunk {c} {s}" for c, s in sorted(moved.items()))
