"""The tenant's day ledger (DESIGN.md §8; spec §16.5 "预留避免并行超支"): the cost units and model
tokens a tenant's tasks used and reserved today, moved in each task event's transaction by the
change in that task's ledger, and refused past the tenant's daily quota."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection
from django.utils import timezone

from apps.core import sql
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


_MOVE_SQL = """
UPDATE {table} SET money_used = money_used + %(mu)s, money_reserved = money_reserved + %(mr)s,
    tokens_used = tokens_used + %(tu)s, tokens_reserved = tokens_reserved + %(tr)s, updated_at = %(now)s
WHERE tenant_id = %(tenant)s AND day = %(day)s
  AND (%(mg)s <= 0 OR money_used + money_reserved + %(mg)s <= %(mq)s)
  AND (%(tg)s <= 0 OR tokens_used + tokens_reserved + %(tg)s <= %(tq)s)
"""


def _day_row_move(task: Task, tenant_id: int, day: datetime.date, deltas: dict[str, tuple[int, int]]) -> None:
    """Move the tenant's ``day`` row by ``deltas`` (``{dim: (used, reserved)}``) in one statement,
    refused past the quota for each dimension that grows. Raises :class:`BudgetExceeded` (nothing
    moved)."""
    quota = task.tenant.quota()
    params = {"tenant": tenant_id, "day": day, "now": timezone.now(),
              "mu": deltas["money"][0], "mr": deltas["money"][1], "tu": deltas["tokens"][0], "tr": deltas["tokens"][1],
              "mg": sum(deltas["money"]), "tg": sum(deltas["tokens"]), "mq": quota["money"], "tq": quota["tokens"]}
    statement = _MOVE_SQL.format(table=TenantUsage._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        if cursor.rowcount == 1:
            return
    TenantUsage.objects.bulk_create([TenantUsage(tenant_id=tenant_id, day=day)], ignore_conflicts=True)
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        if cursor.rowcount == 1:
            return
    row = tenant_day_read(tenant_id, day)
    for dim, (d_used, d_reserved) in deltas.items():
        left = quota[dim] - row[dim]
        if d_used + d_reserved > left:
            raise BudgetExceeded(dim, d_used + d_reserved, left, scope="tenant")
    raise BudgetExceeded("money", deltas["money"][0] + deltas["money"][1], 0, scope="tenant")


_DAY_SQL = ("SELECT money_used + money_reserved, tokens_used + tokens_reserved FROM {table} "
            "WHERE tenant_id = %s AND day = %s")


def tenant_day_read(tenant_id: int, day: datetime.date) -> dict[str, int]:
    """``{"money", "tokens"}``: used + reserved on the tenant's ``day`` row as it stands (0 without
    a row)."""
    with connection.cursor() as cursor:
        cursor.execute(_DAY_SQL.format(table=TenantUsage._meta.db_table), [tenant_id, day])
        row = cursor.fetchone() or (0, 0)
    return {"money": row[0], "tokens": row[1]}


class TenantLedgerBuffer:
    """The tenant day-row moves of one transaction, summed per tenant and day and written once, at
    its end (:meth:`flush`), instead of one ``UPDATE`` per event: the day row is every task of the
    tenant's hot spot, and a transaction that moved it early held its lock — and every other run
    of the tenant waiting on it — until its commit.

    :meth:`admit` checks a move against the day row as last read (once per transaction) plus what
    this transaction added before: past the quota it raises :class:`BudgetExceeded`, before the
    caller writes anything; :meth:`add` records it once the caller wrote its event. :meth:`flush`
    applies the sums under the same quota rule, now under the row's lock; another transaction may
    have used the room since the read, and then it raises :class:`TenantQuotaRace` — the caller's
    transaction must roll back (its next attempt is refused at :meth:`admit`, with the reason)."""

    def __init__(self) -> None:
        self._pending: dict[tuple, dict] = {}
        self._seen: dict[tuple, dict[str, int]] = {}

    def admit(self, task: Task, old: dict, new: dict) -> None:
        """Check the move from ``old`` to ``new`` (task states) against the quota; raises
        :class:`BudgetExceeded` past it. Records nothing (see :meth:`add`)."""
        deltas = _ledger_deltas(old, new)
        if not any(sum(deltas[dim]) > 0 for dim in ("money", "tokens")):
            return
        key = (task.tenant_id, _day(task))
        group = self._pending.get(key) or {"money": (0, 0), "tokens": (0, 0)}
        if key not in self._seen:
            self._seen[key] = tenant_day_read(*key)
        quota = task.tenant.quota()
        for dim in ("money", "tokens"):
            growth = sum(deltas[dim])
            left = quota[dim] - self._seen[key][dim] - sum(group[dim])
            if growth > 0 and growth > left:
                raise BudgetExceeded(dim, growth, left, scope="tenant")

    def add(self, task: Task, old: dict, new: dict) -> None:
        """Record the move from ``old`` to ``new`` (an event now written), for :meth:`flush`."""
        deltas = _ledger_deltas(old, new)
        if not any(any(pair) for pair in deltas.values()):
            return
        key = (task.tenant_id, _day(task))
        group = self._pending.get(key) or {"task": task, "money": (0, 0), "tokens": (0, 0)}
        self._pending[key] = {"task": group["task"], **{dim: (group[dim][0] + deltas[dim][0],
                                                              group[dim][1] + deltas[dim][1])
                                                        for dim in ("money", "tokens")}}

    def flush(self) -> None:
        """Write the summed moves (tenant, then day order). Raises :class:`TenantQuotaRace`."""
        pending, self._pending = self._pending, {}
        self._seen.clear()
        for (tenant_id, day), group in sorted(pending.items(), key=lambda item: (item[0][0], item[0][1])):
            deltas = {dim: group[dim] for dim in ("money", "tokens")}
            if not any(any(pair) for pair in deltas.values()):
                continue
            try:
                _day_row_move(group["task"], tenant_id, day, deltas)
            except BudgetExceeded as exc:
                raise TenantQuotaRace(str(exc)) from exc

    def clear(self) -> None:
        self._pending.clear()
        self._seen.clear()


class TenantQuotaRace(RuntimeError):
    """A transaction's buffered day-row moves no longer fit the tenant's quota at its end: other
    tasks used the room after this one admitted its reservation. Its transaction rolls back."""


def tenant_usage_today(tenant) -> dict:
    """``{"day", "money": {"limit", "used", "reserved"}, "tokens": {...}}`` for ``tenant`` today."""
    day = timezone.now().astimezone(UTC).date()
    row = sql.row(TenantUsage, "t0.day = %s", [day], tenant_id=tenant.pk)
    return _usage(tenant, day, {dim: (getattr(row, f"{dim}_used", 0), getattr(row, f"{dim}_reserved", 0))
                                for dim in ("money", "tokens")})


def _usage(tenant, day, used: dict) -> dict:
    """The dict of :func:`tenant_usage_today` from ``used`` (``{dim: (used, reserved)}``)."""
    quota = tenant.quota()
    return {"day": day.isoformat(), **{dim: {"limit": quota[dim], "used": used[dim][0], "reserved": used[dim][1]}
                                       for dim in ("money", "tokens")}}


_LOAD_SQL = """
SELECT (SELECT count(*) FROM {task} WHERE tenant_id = %(tenant)s AND status = ANY(%(statuses)s)),
       u.money_used, u.money_reserved, u.tokens_used, u.tokens_reserved
FROM (VALUES (1)) AS one LEFT JOIN {usage} u ON u.tenant_id = %(tenant)s AND u.day = %(day)s
"""


def tenant_load_today(tenant, *, statuses) -> tuple[int, dict]:
    """``(how many of tenant's tasks are in one of ``statuses``, the usage of
    :func:`tenant_usage_today`)`` in one statement: what a new request's admission reads, after it
    locked the tenant's row (each part is read after that lock, in the statement's own snapshot)."""
    day = timezone.now().astimezone(UTC).date()
    with connection.cursor() as cursor:
        cursor.execute(_LOAD_SQL.format(task=Task._meta.db_table, usage=TenantUsage._meta.db_table),
                       {"tenant": tenant.pk, "statuses": list(statuses), "day": day})
        active, money_used, money_reserved, tokens_used, tokens_reserved = cursor.fetchone()
    return active, _usage(tenant, day, {"money": (money_used or 0, money_reserved or 0),
                                        "tokens": (tokens_used or 0, tokens_reserved or 0)})
