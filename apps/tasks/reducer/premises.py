"""The premises of a plan version and the rules that judge a read's result by them (``reducer/6``,
long-task-runtime.md: an activated plan is immutable; a late result is accepted, re-validated or
refused by comparing the premises it was computed under with the current ones, never by arrival
order). Pure functions and tables; :mod:`apps.tasks.reducer.v6` folds events with them, and the
runtime (apps/agent/plans.py, apps/agent/reads.py) judges with the same ones."""

from __future__ import annotations

#: the premise keys of a plan version (all JSON values; None where unknown)
PREMISES = ("request", "scopes", "requester_role", "device_version", "device_profile", "policy_version",
            "bundle", "approver_role", "ticket_epoch", "evidence")
#: the reads of a plan, run in parallel as activities
READS = ("device", "ticket", "retrieval")
#: the steps of every plan: its reads, then the draft, the authorization and the write
STEPS = (*READS, "draft", "authorize", "write")
#: the premises each read's result depends on: a change in one of them is decisive for it — for
#: ``evidence``, a change that leaves a chunk of the result superseded, retired or unreadable
#: (:func:`decisive`)
DEPENDS: dict[str, tuple[str, ...]] = {
    "device": ("device_version",),
    "ticket": ("ticket_epoch",),
    "retrieval": ("request", "scopes", "device_profile", "bundle", "evidence"),
}
#: the premises each read observes itself and reports as it found them (apps.agent.reads.read_perform);
#: every other premise of its report is the one it was dispatched under (``activities[id]["premises"]``)
OBSERVES: dict[str, tuple[str, ...]] = {
    "device": ("device_version", "device_profile"),
    "ticket": (),
    "retrieval": ("request", "scopes", "device_version", "device_profile"),
}
#: the read event each step reports by
READ_EVENT = {"device": "device.read", "ticket": "ticket.read", "retrieval": "evidence.retrieved"}
STEP_OF_EVENT = {event: step for step, event in READ_EVENT.items()}

ACCEPTED_, REVALIDATED, REFUSED = "accepted", "revalidated", "refused"


_MISSING = object()


def changed_premises(result: dict, current: dict) -> list[str]:
    """The premise keys (of :data:`PREMISES`, in that order) on which ``result`` (the premises a
    result was computed under) differs from ``current`` (a plan version's premises). A key missing
    from one of them and present in the other counts as changed. Pure."""
    return [k for k in PREMISES if result.get(k, _MISSING) != current.get(k, _MISSING)]


def evidence_moved(evidence: dict | None, refs: list | None = None) -> list[str]:
    """The chunk ids an ``evidence`` premise (``{chunk_id: status}``) marks other than ``current``
    (superseded, retired, unreadable) — only those of ``refs`` (chunk ids) when given. Pure."""
    wanted = None if refs is None else {str(r) for r in refs}
    return sorted(str(c) for c, st in (evidence or {}).items()
                  if st != "current" and (wanted is None or str(c) in wanted))


def decisive(step: str, key: str, current: dict, refs: list | None = None) -> bool:
    """Whether a change of premise ``key`` (already found changed) is decisive for read ``step``'s
    result under the version whose premises are ``current``: ``key`` is one ``step`` depends on
    (:data:`DEPENDS`) and, for ``evidence``, the version marks a chunk of the result not current —
    ``refs``: the result's chunk ids (None: the chunks the version carries, which is what a carried
    retrieval holds). A change that finds the evidence all current is not decisive: the result is
    re-validated. Pure."""
    if key not in DEPENDS[step]:
        return False
    if key == "evidence":
        return bool(evidence_moved(current.get("evidence"), refs))
    return True


def verdict(step: str, result: dict, current: dict, refs: list | None = None) -> tuple[str, list[str]]:
    """How a result of read ``step`` computed under premises ``result`` may enter the plan whose
    premises are ``current``: ``("accepted", [])`` when nothing changed; ``("revalidated", changed)``
    when no change is decisive for the step (:func:`decisive`: the result must be re-checked against
    the world before it joins); ``("refused", decisive)`` when one is. A premise ``result`` does not
    carry counts as changed. ``refs``: a retrieval result's chunk ids (see :func:`decisive`). Pure;
    raises ``KeyError`` for an unknown step."""
    changed = changed_premises(result, current)
    decisive_ = [k for k in changed if decisive(step, k, current, refs)]
    if decisive_:
        return REFUSED, decisive_
    return (REVALIDATED, changed) if changed else (ACCEPTED_, [])


def current_plan(state: dict) -> dict | None:
    """The newest plan version of ``state`` (None before the first)."""
    plans = state.get("plans") or []
    return plans[-1] if plans else None
