"""Metrics (DESIGN.md §1 "admin … see metrics"; spec §16.11).

Every figure is read from PostgreSQL, the single source of truth, with a fixed number of aggregate
queries: the cost of a page or a scrape does not grow with the number of events.

* :func:`prometheus_text` — the ``/metrics`` exposition for the whole service (all tenants, no
  tenant label). Label values come from closed sets (task statuses, tool names, attempt and model
  outcomes), so the series count is bounded. Values are computed at scrape time, so they are right
  whatever number of web processes serves the scrape.
* :func:`tenant_metrics` — the admin's metrics page for one tenant: completion and recovery rates,
  duplicate actions, human interventions, cost and latency percentiles, grouped by artifact version
  and per day.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.db.models import Count, Q, Sum
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from apps.actions.models import ActionAttempt, ActionStatus, AttemptOutcome
from apps.actions.registry import TOOLS
from apps.approvals.models import ApprovalStatus
from apps.outbox.models import OutboxStatus
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.reducer.v3 import MODEL_OUTCOMES
from apps.traces.health import health_check

#: the time a task ended: its terminal event (a later update of the row does not move it)
ENDED_AT = ("LEFT JOIN LATERAL (SELECT min(e.occurred_at) AS at FROM events_taskevent e WHERE e.task_id = t.id "
            "AND e.type IN ('task.completed', 'task.failed', 'cancel.requested')) ended ON true")

#: events that show a task met a fault and recovered from it (or tried to)
RECOVERY_EVENTS = ("outcome.unknown", "reconciliation.retry", "dispatch.conflict", "approval.invalidated")


def _bounded(value: str | None, allowed) -> str:
    return value if value in allowed else "other"


def _merged(rows) -> list[tuple[tuple, int]]:
    """``(labels, value)`` rows with equal labels added up (values outside a closed set all become
    ``other``, and a scrape must not carry one series twice)."""
    out: dict[tuple, int] = {}
    for labels, value in rows:
        out[labels] = out.get(labels, 0) + value
    return sorted(out.items())


class _DatabaseCollector:
    """A prometheus_client collector reading the counts from PostgreSQL at each scrape."""

    def collect(self):
        with connection.cursor() as cur:
            cur.execute("SELECT status, count(*) FROM tasks_task GROUP BY status")
            by_status = dict(cur.fetchall())
            cur.execute("SELECT a.tool, a.status, count(*) FROM actions_action a GROUP BY a.tool, a.status")
            actions = cur.fetchall()
            cur.execute("SELECT a.tool, t.outcome, count(*) FROM actions_actionattempt t "
                        "JOIN actions_action a ON a.id = t.action_id GROUP BY a.tool, t.outcome")
            attempts = cur.fetchall()
            cur.execute("SELECT status, count(*) FROM outbox_outboxmessage GROUP BY status")
            outbox = dict(cur.fetchall())
            cur.execute("SELECT status, count(*) FROM approvals_approvalrequest GROUP BY status")
            approvals = dict(cur.fetchall())
            cur.execute("SELECT payload->>'outcome', count(*), coalesce(sum((payload->'used'->>'tokens')::bigint), 0), "
                        "coalesce(sum((payload->'used'->>'money')::bigint), 0) FROM events_taskevent "
                        "WHERE type = 'model.called' GROUP BY 1")
            model = cur.fetchall()
            cur.execute("SELECT coalesce(sum(budget_used), 0), coalesce(sum(budget_reserved), 0) FROM tasks_task")
            used, reserved = cur.fetchone()
            cur.execute("SELECT count(*) FROM events_refusedevent")
            refused = cur.fetchone()[0]

        statuses = reducer.ALL_STATUSES
        g = GaugeMetricFamily("faultdesk_tasks", "Tasks by current status.", labels=["status"])
        for s in statuses:
            g.add_metric([s], by_status.get(s, 0))
        yield g
        yield CounterMetricFamily("faultdesk_tasks_accepted", "Tasks accepted since the database was created.",
                                  value=sum(by_status.values()))
        tools = set(TOOLS)
        a = GaugeMetricFamily("faultdesk_actions", "Actions (logical external writes) by tool and status.",
                              labels=["tool", "status"])
        for labels, n in _merged(((_bounded(t, tools), _bounded(st, ActionStatus.values)), n)
                                 for t, st, n in actions):
            a.add_metric(list(labels), n)
        yield a
        d = CounterMetricFamily("faultdesk_dispatch_attempts", "Dispatch attempts to ticket systems by tool and "
                                "outcome (SKIPPED: written before a request that never left).",
                                labels=["tool", "outcome"])
        for labels, n in _merged(((_bounded(t, tools), _bounded(o, AttemptOutcome.values)), n)
                                 for t, o, n in attempts):
            d.add_metric(list(labels), n)
        yield d
        o = GaugeMetricFamily("faultdesk_outbox_messages", "Outbox rows by status.", labels=["status"])
        for s in OutboxStatus.values:
            o.add_metric([s], outbox.get(s, 0))
        yield o
        ap = GaugeMetricFamily("faultdesk_approvals", "Approval requests by status.", labels=["status"])
        for s in ApprovalStatus.values:
            ap.add_metric([s], approvals.get(s, 0))
        yield ap
        calls = CounterMetricFamily("faultdesk_model_calls", "Model calls by outcome.", labels=["outcome"])
        tokens = CounterMetricFamily("faultdesk_model_tokens", "Model tokens charged to task ledgers.")
        total_tokens = sum(tok for _, _, tok, _ in model)
        for labels, n in _merged(((_bounded(o, MODEL_OUTCOMES),), n) for o, n, _, _ in model):
            calls.add_metric(list(labels), n)
        tokens.add_metric([], total_tokens)
        yield calls
        yield tokens
        yield CounterMetricFamily("faultdesk_cost_units_used", "Cost units settled on task ledgers.", value=used)
        yield GaugeMetricFamily("faultdesk_cost_units_reserved", "Cost units reserved and not yet settled.",
                                value=reserved)
        yield CounterMetricFamily("faultdesk_refused_events", "Events the reducer refused (late, stale or "
                                  "illegal), recorded and never applied.", value=refused)


class _HealthCollector:
    """The figures ``/healthz`` decides on (apps/traces/health.py), as gauges."""

    def collect(self):
        health = health_check()
        up = GaugeMetricFamily("faultdesk_up", "1 when the component answers.", labels=["component"])
        up.add_metric(["database"], int(health.database))
        up.add_metric(["broker"], int(health.broker))
        yield up
        yield GaugeMetricFamily("faultdesk_healthy", "1 when /healthz answers 200.", value=int(health.ok))
        yield GaugeMetricFamily("faultdesk_oldest_transaction_seconds", "Age of the oldest open transaction of "
                                "another session.", value=health.oldest_transaction_seconds)
        yield GaugeMetricFamily("faultdesk_outbox_lag_seconds", "How long the oldest due outbox row has waited.",
                                value=health.outbox_lag_seconds)


#: Cache key of the last exposition: a scrape within METRICS_CACHE_SECONDS of the previous one
#: costs no query (the aggregates read whole tables).
METRICS_CACHE_KEY = "faultdesk:metrics:exposition"


def prometheus_text() -> bytes:
    """The Prometheus text exposition of the service's counters and gauges, computed at most
    once per ``FAULTDESK["METRICS_CACHE_SECONDS"]`` per cache (0: every scrape)."""
    ttl = settings.FAULTDESK["METRICS_CACHE_SECONDS"]
    if ttl and (cached := cache.get(METRICS_CACHE_KEY)) is not None:
        return cached
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_DatabaseCollector())
    registry.register(_HealthCollector())
    text = generate_latest(registry)
    if ttl:
        cache.set(METRICS_CACHE_KEY, text, ttl)
    return text


# --- the admin's metrics page ----------------------------------------------------------------------

@dataclass(frozen=True)
class VersionRow:
    """Figures of the tasks that share one artifact version (reducer, model, prompt template)."""

    reducer: str
    model: str
    prompt_template: str
    tasks: int
    completed: int
    failed: int
    cancelled: int
    cost_p50: float | None
    cost_p95: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None

    @property
    def completion_rate(self) -> float | None:
        ended = self.completed + self.failed + self.cancelled
        return self.completed / ended if ended else None


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def tenant_metrics(*, tenant_id: int, days: int = 14) -> dict:
    """The metrics page's figures for one tenant. Returns ``{"totals", "rates", "by_version",
    "by_day", "interventions"}``; rates are in [0, 1] or None when nothing was measured. Runs a
    fixed number of queries whatever the number of tasks and events."""
    tasks = Task.objects.for_tenant(tenant_id)
    terminal = list(reducer.TERMINAL)
    totals = tasks.aggregate(
        tasks=Count("id"), completed=Count("id", filter=Q(status=reducer.COMPLETED)),
        failed=Count("id", filter=Q(status=reducer.FAILED)), cancelled=Count("id", filter=Q(status=reducer.CANCELLED)),
        open=Count("id", filter=~Q(status__in=terminal)), cost_used=Sum("budget_used"),
    )
    with connection.cursor() as cur:
        # tasks that met a fault (unknown outcome, conflict, invalidated approval, a worker that died
        # inside an activity) and how many of them still completed
        cur.execute(
            "SELECT count(DISTINCT t.id), count(DISTINCT t.id) FILTER (WHERE t.status = %s) "
            "FROM tasks_task t JOIN events_taskevent e ON e.task_id = t.id "
            "WHERE t.tenant_id = %s AND (e.type = ANY(%s) OR (e.type = 'budget.settled' "
            "AND (e.payload->>'unknown_outcome')::boolean))",
            [reducer.COMPLETED, tenant_id, list(RECOVERY_EVENTS)])
        faulted, recovered = cur.fetchone()
        cur.execute(
            "SELECT coalesce(t.artifact_bundle->>'reducer', 'reducer/1'), "  # noqa: S608 - ENDED_AT is a constant
            "coalesce(t.artifact_bundle->>'model', ''), "
            "coalesce(t.artifact_bundle->>'prompt_template', ''), count(*), "
            "count(*) FILTER (WHERE status = 'COMPLETED'), count(*) FILTER (WHERE status = 'FAILED'), "
            "count(*) FILTER (WHERE status = 'CANCELLED'), "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY budget_used) FILTER (WHERE status = ANY(%s)), "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY budget_used) FILTER (WHERE status = ANY(%s)), "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM ended.at - t.created_at)) "
            "FILTER (WHERE status = ANY(%s)), "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM ended.at - t.created_at)) "
            "FILTER (WHERE status = ANY(%s)) "
            f"FROM tasks_task t {ENDED_AT} WHERE t.tenant_id = %s GROUP BY 1, 2, 3 ORDER BY 4 DESC LIMIT 20",
            [terminal, terminal, terminal, terminal, tenant_id])
        by_version = [VersionRow(*row[:7], *(round(float(v), 3) if v is not None else None for v in row[7:]))
                      for row in cur.fetchall()]
        since = timezone.now() - timedelta(days=days)
        cur.execute(
            "SELECT date_trunc('day', t.created_at)::date, count(*), "  # noqa: S608 - ENDED_AT is a constant
            "count(*) FILTER (WHERE status = 'COMPLETED'), "
            "count(*) FILTER (WHERE status = 'FAILED'), count(*) FILTER (WHERE status = 'CANCELLED'), "
            "coalesce(sum(budget_used), 0), "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM ended.at - t.created_at)) "
            f"FILTER (WHERE ended.at IS NOT NULL) FROM tasks_task t {ENDED_AT} "
            "WHERE t.tenant_id = %s AND t.created_at >= %s GROUP BY 1 ORDER BY 1", [tenant_id, since])
        by_day = [{"day": d, "tasks": n, "completed": c, "failed": f, "cancelled": x, "cost": int(cost),
                   "completion": _rate(c, c + f + x),
                   "latency_p95_s": round(float(p95), 3) if p95 is not None else None}
                  for d, n, c, f, x, cost, p95 in cur.fetchall()]
        # people stepping in: approval decisions (not carried over), reconciliation resolutions,
        # compensation decisions — each recorded as an event with a person as its actor
        cur.execute(
            "SELECT e.type, count(*) FROM events_taskevent e WHERE e.tenant_id = %s AND e.actor LIKE 'user:%%' "
            "AND e.type IN ('approval.granted', 'approval.rejected', 'receipt.recorded', 'dispatch.failed', "
            "'compensation.retry', 'compensation.resolved', 'input.provided') GROUP BY 1", [tenant_id])
        interventions = dict(cur.fetchall())
        # duplicate actions: the same write (task, tool, parameter digest) that succeeded more than once
        # (under different keys); one key is one action by construction
        cur.execute(
            "SELECT count(*) FROM (SELECT 1 FROM actions_action WHERE tenant_id = %s AND status = %s "
            "GROUP BY task_id, tool, params_digest HAVING count(*) > 1) d", [tenant_id, ActionStatus.SUCCEEDED])
        duplicates = cur.fetchone()[0]
    ended = totals["completed"] + totals["failed"] + totals["cancelled"]
    return {
        "totals": {**totals, "cost_used": totals["cost_used"] or 0, "faulted": faulted, "recovered": recovered,
                   "duplicate_actions": duplicates, "attempts": ActionAttempt.objects.for_tenant(tenant_id)
                   .exclude(outcome=AttemptOutcome.SKIPPED).count()},
        "rates": {"completion": _rate(totals["completed"], ended), "recovery": _rate(recovered, faulted)},
        "by_version": by_version,
        "by_day": by_day,
        "interventions": {"total": sum(interventions.values()), **interventions},
    }
