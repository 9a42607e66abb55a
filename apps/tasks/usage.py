"""The tenant's day ledger (DESIGN.md §8; spec §16.5 "预留避免并行超支"): the cost units and model
tokens a tenant's tasks used and reserved today, moved in each task event's transaction by the
change in that task's ledger, and refused past the tenant's daily quota."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db.models import F
from django.utils import timezone

from apps.tasks.models import Task, TenantUsage


class BudgetExceeded(Exception):
    """A reservation was not admitted: ``dimension`` (``money``, ``tokens``, ``tool_calls``,
    ``retries``) would pass its limit. ``scope`` is ``"task"`` or ``"tenant"``."""

    def __init__(self, dimension: str, requested: int, available: int, scope: str = "task"):
        super().__init__(f"{scope} {dimension}: requested {requested}, {max(available, 0)} left")
        self.dimension, self.requested, self.available, self.scope = dimension, requested, available, scope

    @property
    def reason(self) -> str:
        """The termination reason of a task stopped by this limit."""
        what = "tenant_quota_exhausted" if self.scope == "tenant" else "budget_exhausted"
        return f"{what}: {self}"


def _day(task: Task) -> datetime.date:
    created = task.created_at or timezone.now()
    return created.astimezone(UTC).date()


def tenant_ledger_apply(task: Task, old: dict, new: dict) -> None:
    """Move the tenant's day row (:class:`~apps.tasks.models.TenantUsage`) by the change from
    ``old`` to ``new`` in the task's money and token ledgers. Called inside the event's
    transaction. Raises :class:`BudgetExceeded` (scope ``tenant``) when ``used + reserved``
    would grow past the tenant's daily quota; the event's transaction then rolls back."""
    tenant_ledger_apply_many([(task, old, new)])


def tenant_ledger_moves(old: dict, new: dict) -> bool:
    """Does the change from task state ``old`` to ``new`` move the tenant's day row at all?"""
    return any(any(pair) for pair in _ledger_deltas(old, new).values())


def _ledger_deltas(old: dict, new: dict) -> dict[str, tuple[int, int]]:
    def acct(state: dict, dim: str) -> dict:
        if dim == "money":
            return state["budget"]
        return (state.get("limits") or {}).get(dim) or {"used": 0, "reserved": 0}

    return {dim: (acct(new, dim)["used"] - acct(old, dim)["used"],
                  acct(new, dim)["reserved"] - acct(old, dim)["reserved"]) for dim in ("money", "tokens")}


def tenant_ledger_apply_many(changes: list[tuple[Task, dict, dict]]) -> None:
    """:func:`tenant_ledger_apply` for several events of one transaction (``[(task, old, new)]``,
    the batched receipts of the outbox): the changes are summed per tenant and day, and each day
    row is moved once, by the sum, under the same quota rule (checked against the sum, so a batch
    that would pass the quota only as a whole raises :class:`BudgetExceeded` and rolls back; its
    caller then records the events one by one, each checked alone)."""
    groups: dict[tuple, dict] = {}
    for task, old, new in changes:
        if "limits" not in new:
            continue
        deltas = _ledger_deltas(old, new)
        if not any(any(pair) for pair in deltas.values()):
            continue
        key = (task.tenant_id, _day(task))
        group = groups.setdefault(key, {"task": task, "money": (0, 0), "tokens": (0, 0)})
        for dim, (d_used, d_reserved) in deltas.items():
            group[dim] = (group[dim][0] + d_used, group[dim][1] + d_reserved)
    for (tenant_id, day), group in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1])):
        _day_row_move(group["task"], tenant_id, day, {dim: group[dim] for dim in ("money", "tokens")})


def _day_row_move(task: Task, tenant_id: int, day: datetime.date, deltas: dict[str, tuple[int, int]]) -> None:
    TenantUsage.objects.bulk_create([TenantUsage(tenant_id=tenant_id, day=day)], ignore_conflicts=True)
    rows = TenantUsage.objects.for_tenant(tenant_id).filter(day=day)
    quota = task.tenant.quota()
    for dim, (d_used, d_reserved) in deltas.items():
        growth = d_used + d_reserved
        if growth > 0:
            rows = rows.filter(**{f"{dim}_used__lte": quota[dim] - growth - F(f"{dim}_reserved")})
    updated = rows.update(money_used=F("money_used") + deltas["money"][0],
                          money_reserved=F("money_reserved") + deltas["money"][1],
                          tokens_used=F("tokens_used") + deltas["tokens"][0],
                          tokens_reserved=F("tokens_reserved") + deltas["tokens"][1],
                          updated_at=timezone.now())
    if updated != 1:
        row = TenantUsage.objects.for_tenant(tenant_id).get(day=day)
        for dim, (d_used, d_reserved) in deltas.items():
            left = quota[dim] - getattr(row, f"{dim}_used") - getattr(row, f"{dim}_reserved")
            if d_used + d_reserved > left:
                raise BudgetExceeded(dim, d_used + d_reserved, left, scope="tenant")
        raise BudgetExceeded("money", deltas["money"][0] + deltas["money"][1], 0, scope="tenant")


def tenant_usage_today(tenant) -> dict:
    """``{"day", "money": {"limit", "used", "reserved"}, "tokens": {...}}`` for ``tenant`` today."""
    day = timezone.now().astimezone(UTC).date()
    row = TenantUsage.objects.for_tenant(tenant.pk).filter(day=day).first()
    quota = tenant.quota()
    return {"day": day.isoformat(), **{dim: {"limit": quota[dim], "used": getattr(row, f"{dim}_used", 0),
                                             "reserved": getattr(row, f"{dim}_reserved", 0)}
                                       for dim in ("money", "tokens")}}
