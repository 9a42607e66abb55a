"""Reads for the trace: a task's plan versions side by side (``reducer/6``; long-task-runtime.md:
PlanVersion, Replan Barrier; docs/adr/0022).

:func:`plan_versions` answers, for an admin of the task's tenant, what the trace shows of
``state["plans"]``: one :class:`PlanColumn` per version — its premises (each marked when it differs
from the previous version's), its reason, its barrier and the read activities dispatched under it
with their verdicts — in two queries whatever the number of versions and activities. A task of an
earlier reducer has no plans: None, and the trace has no such section.

Everything here is recorded data, kept as recorded (English sentences, codes): the template's
``plan_labels`` filters put it in the reader's language. The premise ``evidence`` is chunk ids and
their statuses only — never an excerpt — and each id says whether the viewer may open it now."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db.models import F

from apps.accounts.principal import Principal
from apps.evidence.selectors import readable_chunk_ids
from apps.tasks.models import Task
from apps.tasks.reducer import v6
from apps.tasks.selectors import task_events

#: the events that say what became of a read activity, and the plan versions they were judged under
_ACTIVITY_EVENTS = (*v6.READ_EVENT.values(), "result.refused", "read.failed", "budget.settled", "plan.activated")


#: the status of an activity that reported when nothing waited for it — the task had moved on, or
#: another read of its step had joined first — so only its cost was recorded: the state's own
#: (``reducer/6`` marks it at that ``budget.settled``), or shown for a log from before that mark,
#: whose state still holds it as dispatched
UNJOINED = v6.UNJOINED


@dataclass
class Activity:
    """One read activity of a plan version: ``status`` is the state's (``dispatched``, ``accepted``,
    ``revalidated``, ``refused``, ``failed``, ``lapsed``, ``unjoined``), or :data:`UNJOINED` (an older
    log's settled read the state still holds dispatched); ``seq`` the event that reported it (None
    while in flight), ``judged_under`` the plan version current when it reported; ``revalidation``
    ``{"ok", "checked", "why"}`` as recorded; ``reason`` a refusal's, ``error`` a failure's,
    ``settled`` the reason recorded when only its cost was (a lapse, or a report nothing waited
    for); ``changed`` the premises on which the result differed from the version it was judged
    under (what made it re-validated or refused)."""

    id: str
    step: str
    status: str
    seq: int | None = None
    judged_under: int | None = None
    revalidation: dict | None = None
    reason: str = ""
    error: str = ""
    settled: str = ""
    changed: list[str] = field(default_factory=list)


@dataclass
class PremiseCell:
    """A premise's value in one version; ``changed`` when it differs from the previous version's;
    ``first_set`` when that difference is only that the previous version had no value yet (the
    approver's role before anyone approved): the table says "set", not "changed" (what is
    recorded, and the column's ``changed`` keys, stay as they are)."""

    value: object
    changed: bool = False
    first_set: bool = False


@dataclass
class PremiseRow:
    key: str
    cells: list[PremiseCell]


@dataclass
class PlanColumn:
    """One plan version as recorded (``reason``, ``barrier``: None for the first) with its
    activities in dispatch order and the premise keys that changed from the previous version."""

    version: int
    reason: str
    barrier: dict | None
    changed: list[str]
    activities: list[Activity] = field(default_factory=list)


@dataclass
class PlanTrace:
    """The plan versions of a task: ``columns`` oldest first, ``premises`` one row per premise key
    (cells in column order), ``readable`` the chunk ids of the evidence premises the viewer may open."""

    columns: list[PlanColumn]
    premises: list[PremiseRow]
    readable: set[str]

    def as_dict(self) -> list[dict]:
        """The versions as JSON values (the trace export): each version with its premises, the keys
        that changed, its reason, barrier and activities."""
        return [{"version": c.version, "premises": {row.key: row.cells[i].value for row in self.premises},
                 "changed": c.changed, "reason": c.reason, "barrier": c.barrier,
                 "activities": [{"id": a.id, "step": a.step, "status": a.status, "seq": a.seq,
                                 "judged_under": a.judged_under, "revalidation": a.revalidation,
                                 "changed": a.changed, "reason": a.reason or None, "error": a.error or None,
                                 "settled": a.settled or None}
                                for a in c.activities]}
                for i, c in enumerate(self.columns)]


#: premises whose empty value is a value of its own, not "not known yet": no evidence carried means the
#: version retrieves afresh, so carrying some is a change, not a first setting
_NONE_IS_A_VALUE = {"evidence"}


def plan_columns(state: dict, reports: list[dict], readable: set[str]) -> PlanTrace | None:
    """The :class:`PlanTrace` of a task's ``state`` (None without plans) from ``reports``: rows
    ``{"seq", "type", "activity_id", "reservation_id", "version", "premises", "revalidation", "reason",
    "error", "unknown_outcome"}`` of its events of :data:`_ACTIVITY_EVENTS` in seq order (what
    :func:`plan_versions` reads). Pure."""
    plans = state.get("plans") or []
    if not plans:
        return None
    columns, previous = [], None
    for plan in plans:
        changed = v6.changed_premises(previous, plan["premises"]) if previous is not None else []
        columns.append(PlanColumn(version=plan["version"], reason=plan.get("reason") or "",
                                  barrier=plan.get("barrier"), changed=changed))
        previous = plan["premises"]
    rows = [PremiseRow(key=k, cells=[PremiseCell(value=plan["premises"].get(k), changed=k in col.changed,
                                                 first_set=k in col.changed and k not in _NONE_IS_A_VALUE
                                                 and i > 0 and plans[i - 1]["premises"].get(k) is None)
                                     for i, (plan, col) in enumerate(zip(plans, columns, strict=True))])
            for k in v6.PREMISES]
    activities = state.get("activities") or {}
    found = {aid: Activity(id=aid, step=act["step"], status=act["status"]) for aid, act in activities.items()}
    current = None
    for r in reports:
        if r["type"] == "plan.activated":
            current = r.get("version")
            continue
        a = found.get(r.get("activity_id") or r.get("reservation_id"))
        if a is None:
            continue
        if r["type"] == "budget.settled":
            if r.get("unknown_outcome") or a.status in ("dispatched", UNJOINED):
                a.settled = r.get("reason") or ""
            if a.status == "dispatched" and not r.get("unknown_outcome"):
                a.status = UNJOINED
            continue
        a.seq, a.judged_under = r["seq"], current
        judged = plans[current - 1]["premises"] if isinstance(current, int) and 0 < current <= len(plans) else None
        if isinstance(r.get("premises"), dict) and judged is not None:
            a.changed = v6.changed_premises(r["premises"], judged)
        a.revalidation = r.get("revalidation")
        a.reason = (r.get("reason") or "") if r["type"] == "result.refused" else ""
        a.error = r.get("error") or ""
    by_version = {c.version: c for c in columns}
    for aid, act in activities.items():
        if (column := by_version.get(act["plan_version"])) is not None:
            column.activities.append(found[aid])
    for column in columns:  # the state's JSON keeps no order: by step, then in the order they reported
        column.activities.sort(key=lambda a: (v6.READS.index(a.step) if a.step in v6.READS else len(v6.READS),
                                              a.seq if a.seq is not None else float("inf"), a.id))
    return PlanTrace(columns=columns, premises=rows, readable=readable)


def evidence_chunk_ids(state: dict) -> set[str]:
    """The chunk ids every plan version's ``evidence`` premise names."""
    return {cid for plan in state.get("plans") or [] for cid in (plan["premises"].get("evidence") or {})}


def plan_versions(*, principal: Principal, task: Task) -> PlanTrace | None:
    """The plan versions of ``task`` as ``principal`` (an admin of its tenant; the caller has checked
    access to ``task``) may see them; None for a task without plans (reducer/1–5, or not yet
    planned), at no query. Otherwise two queries: the events that reported the reads (only the
    fields named, never a payload's evidence or reading), and which of the premises' chunks the
    viewer may read now."""
    state = task.state or {}
    if not state.get("plans"):
        return None
    keys = ("activity_id", "reservation_id", "version", "premises", "revalidation", "reason", "error",
            "unknown_outcome")
    reports = list(task_events(principal=principal, task=task).filter(type__in=_ACTIVITY_EVENTS)
                   .values("seq", "type", **{k: F(f"payload__{k}") for k in keys}))
    chunk_ids = evidence_chunk_ids(state)
    readable = {str(c) for c in readable_chunk_ids(tenant_id=principal.tenant_id, scopes=principal.scopes,
                                                    chunk_ids=[int(c) for c in chunk_ids if str(c).isdigit()])} \
        if chunk_ids else set()
    return plan_columns(state, reports, readable)
