"""The budget ledger's writes and deadline propagation (DESIGN.md §8; spec §16.5
"预留避免并行超支", runtime-invariants.md §1.2).

A task's ledger lives in its event-sourced state (``reducer/3``): ``budget`` (cost units ``B, U,
R``) and ``limits`` (tokens, tool calls, retries). Every change is an event, so the ledger always
equals the replay of the log, and the trace shows the budget over time.

Writers here lock the task row (``SELECT … FOR UPDATE``) and append with the usual CAS, so
reservations from many processes against one task serialize on that row and none is lost to a
CAS retry. The check ``U + R + r ≤ B`` is made three times: here (to name the limit), by δ (the
event is refused), and by the task row's ``CHECK`` constraint. The tenant's day row moves in the
same transaction (:func:`tenant_ledger_apply`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.core import sql
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.reducer import v3 as reducer_v3
from apps.tasks.runs import event_transaction, run_current_task
from apps.tasks.store import refused_after_rollback, task_append_event
from apps.tasks.usage import BudgetExceeded


@dataclass(frozen=True)
class Reservation:
    """An admitted reservation: its id, the amounts reserved, the activity's timeout (seconds)."""

    id: str
    amounts: dict
    timeout_s: float | None


def _locked(task_id: uuid.UUID) -> Task:
    """The task row, locked (``FOR UPDATE OF`` the task only: its tenant is read, not locked — a lock
    on the tenant row would serialize every ledger write of the tenant and block the foreign-key
    checks of its other transactions at commit)."""
    task = sql.row(Task, "t0.id = %s", [task_id], related=("tenant",), tail="FOR UPDATE OF t0")
    if task is None:
        raise Task.DoesNotExist(f"task {task_id}")
    return task


def _current_or_locked(task_id: uuid.UUID, lease_generation: int | None) -> Task:
    """The lease holder's in-memory task when its run's transaction holds the row under
    ``lease_generation`` (locked by this transaction, so current without a read:
    :func:`~apps.tasks.runs.run_current_task`), else the row read and locked (:func:`_locked`)."""
    return run_current_task(task_id, lease_generation) or _locked(task_id)


def _append(task: Task, event_type: str, payload: dict, actor: str, lease_generation: int | None) -> Task:
    return task_append_event(task=task, event_type=event_type, payload=payload, actor=actor,
                             lease_generation=lease_generation)


def budget_reserve(*, task_id: uuid.UUID, activity: str, amounts: dict, actor: str,
                   lease_generation: int | None = None, timeout_s: float | None = None,
                   task: Task | None = None, extra: dict | None = None,
                   bound_to_lease: bool = True) -> tuple[Task, Reservation]:
    """Admit an activity by reserving ``amounts`` (``{"money", "tokens", "tool_calls", "retries"}``,
    non-negative ints; missing ones are 0) on task ``task_id``: one ``budget.reserved`` event,
    atomic with the tenant's day row. ``task``: the task as a lease holder read it in its run's
    transaction (not read and locked again; the CAS still refuses it if it moved meanwhile).
    ``extra``: more payload (a read activity's ``step``, ``plan_version`` and ``deadline``,
    ``reducer/6``). ``bound_to_lease=False``: the activity outlives the lease that admitted it (a
    read activity reports under a lease of its own), so a later lease does not charge it as stale
    (:func:`stale_reservations`); its deadline does.

    Returns ``(task, reservation)``. Raises :class:`BudgetExceeded` (nothing written) when any
    dimension of the task or of its tenant's daily quota would pass its limit;
    :class:`~apps.tasks.reducer.IllegalTransition` when the task may not start activities now
    (e.g. cancelled); :class:`~apps.tasks.store.StaleWrite` when ``lease_generation`` is no
    longer the task's fencing token.
    """
    amounts = {d: int(amounts.get(d, 0)) for d in reducer_v3.DIMENSIONS}
    rid = str(uuid.uuid4())
    with event_transaction() as lean:
        task = task if task is not None and task.pk == task_id else _current_or_locked(task_id, lease_generation)
        if task.status in (reducer.RETRIEVING, reducer.PROPOSING, reducer.VALIDATING):
            room = reducer_v3.headroom(task.state)
            for dim in reducer_v3.DIMENSIONS:
                if amounts[dim] > room[dim]:
                    raise BudgetExceeded(dim, amounts[dim], room[dim])
        payload = {**(extra or {}), "reservation_id": rid, "activity": activity, "amounts": amounts,
                   "generation": lease_generation if bound_to_lease else None, "timeout_s": timeout_s,
                   "reserved_at": timezone.now().isoformat()}
        try:
            task = _append(task, "budget.reserved", payload, actor, lease_generation)
        except reducer.IllegalTransition as exc:
            if lean:
                raise  # recorded as refused in the run's transaction, which goes on
            transaction.set_rollback(True)
            refused = exc
        else:
            refused = None
    if refused is not None:
        refused_after_rollback(task_id=task_id, event_type="budget.reserved", payload=payload, reason=refused.reason,
                               actor=actor, lease_generation=lease_generation)
        raise refused
    return task, Reservation(id=rid, amounts=amounts, timeout_s=timeout_s)


def budget_settle(*, task_id: uuid.UUID, reservation_id: str, used: dict, actor: str,
                  lease_generation: int | None = None, event_type: str = "budget.settled",
                  extra: dict | None = None, task: Task | None = None) -> Task:
    """Settle a reservation at its real cost ``used`` (per dimension ``0 ≤ c ≤ r``): ``U += c,
    R -= r``. ``event_type`` is ``budget.settled`` or ``model.called`` (whose ``extra`` payload
    records the call). Legal after a cancel too: the cost happened. ``task``: as for
    :func:`budget_reserve` — only for a settlement in the same transaction as the task was read
    (an activity that ran outside it may have seen the task move: read it again).

    Raises :class:`~apps.tasks.reducer.IllegalTransition` (recorded as refused) when the
    reservation is no longer open — a late result whose reservation was released — or ``c > r``;
    :class:`~apps.tasks.store.StaleWrite` when the fencing token moved on.
    """
    payload = {**(extra or {}), "reservation_id": reservation_id,
               "used": {d: int(used.get(d, 0)) for d in reducer_v3.DIMENSIONS},
               "settled_at": timezone.now().isoformat()}
    lean = False
    try:
        with event_transaction() as lean:
            task = task if task is not None and task.pk == task_id else _current_or_locked(task_id, lease_generation)
            return _append(task, event_type, payload, actor, lease_generation)
    except reducer.IllegalTransition as exc:
        if not lean:  # in a run's transaction the refusal stands as recorded
            refused_after_rollback(task_id=task_id, event_type=event_type, payload=payload, reason=exc.reason,
                                   actor=actor, lease_generation=lease_generation)
        raise


def budget_release(*, task_id: uuid.UUID, reservation_ids: list[str], reason: str, actor: str,
                   lease_generation: int | None = None) -> Task:
    """Release unused reservations (``R -= r``): one ``budget.released`` event. Ids no longer
    open are skipped; with none left, nothing is written. Returns the task."""
    with event_transaction():
        task = _locked(task_id)
        open_ids = [rid for rid in reservation_ids if rid in (task.state.get("reservations") or {})]
        if not open_ids:
            return task
        return _append(task, "budget.released", {"reservation_ids": open_ids, "reason": reason[:300]},
                       actor, lease_generation)


def stale_reservations(task: Task, generation: int) -> list[str]:
    """Open reservations made under an older lease than ``generation``: their worker lost the
    lease (it died or was fenced), so nobody will settle them."""
    return [rid for rid, r in (task.state.get("reservations") or {}).items()
            if r.get("generation") is not None and r["generation"] < generation]


def orphaned_reservations_settle(*, task_id: uuid.UUID) -> bool:
    """The sweeper's close-out for a task nobody holds a lease on (free or expired) that still
    has open reservations — e.g. cancelled while a worker that then died was calling the model.
    What the activity did is unknown, so each is charged at its reservation (``c = r``). Returns
    True when it settled something."""
    now = timezone.now()
    with transaction.atomic():
        task = _locked(task_id)
        held = task.lease_owner is not None and task.lease_expires_at is not None and task.lease_expires_at >= now
        open_ = dict((task.state or {}).get("reservations") or {})
        if held or not open_:
            return False
        for rid, r in open_.items():
            task = _append(task, "budget.settled", {
                "reservation_id": rid, "used": r["amounts"], "unknown_outcome": True, "settled_at": now.isoformat(),
                "reason": "the activity's worker lost its lease without settling: charged at its reservation"},
                "sweeper", None)
    return True


# --- the tenant's day ledger ------------------------------------------------------------------------


# --- deadline propagation -----------------------------------------------------------------------------

def activity_timeout(task: Task, *, wanted: float, now: datetime | None = None) -> float | None:
    """The timeout (seconds) a child activity of ``task`` may have: at most ``wanted`` and at most
    the task's remaining time minus ``ACTIVITY_CLEANUP_SECONDS`` (to persist the result and clean
    up). None when less than ``ACTIVITY_MIN_SECONDS`` would be left: the activity must not start."""
    conf = settings.FAULTDESK
    now = now or timezone.now()
    remaining = (task.deadline_at - now).total_seconds() - conf["ACTIVITY_CLEANUP_SECONDS"]
    timeout = min(float(wanted), remaining)
    return round(timeout, 3) if timeout >= conf["ACTIVITY_MIN_SECONDS"] else None
