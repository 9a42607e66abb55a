"""Phase 7, retention: the purge over a 100,000-task history (``python -m tools.bench --only
retention [--history 100000]``).

Seeding, in-process on the bench database: three real tasks are driven through the main job
against the reference service — one completed with its ticket, one cancelled, one waiting for
approval — and copied (:func:`tools.bench.history.clone_history`) until the history holds
``history`` tasks, their ages spread evenly over 0–400 days. Then ``VACUUM ANALYZE``, and:

- ``retention.table_bytes.before.<table>`` / ``.after.<table>``: ``pg_total_relation_size`` of each
  table the purge touches, before and after the purge (after a plain ``VACUUM``, which makes the
  space reusable but does not give it back) and after ``VACUUM FULL`` (what the disk gets back);
- per purge run (the default batch, a time budget of ``budget`` seconds each, until a run reaches
  the end): its seconds and the rows and bytes it purged per table, and the totals;
- the replay of a sample of 200 tasks after the purge (ok or purged, never divergent).
"""

from __future__ import annotations

import time
import uuid

from tools.bench.harness import Bench
from tools.bench.seed import SYMPTOMS, tenant_seed

SLUG = "retention"
TABLES = ("tasks_task", "events_taskevent", "events_tasksnapshot", "events_refusedevent", "actions_actionattempt",
          "outbox_outboxmessage", "tickets_inboundwebhook", "approvals_approvalrequest", "actions_action")


def _sizes() -> dict[str, int]:
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT relname, pg_total_relation_size(c.oid) FROM pg_class c WHERE relname = ANY(%s)",
                    [list(TABLES)])
        return dict(cur.fetchall())


def _vacuum(full: bool = False) -> None:
    from django.db import connection

    with connection.cursor() as cur:
        for table in TABLES:
            cur.execute(f"VACUUM {'FULL ' if full else ''}ANALYZE {table}")


def _templates(bench: Bench):
    """The three template tasks (completed, cancelled, waiting for approval), driven in-process."""
    from django.contrib.auth import get_user_model

    from apps.accounts.principal import principal_for_user
    from apps.agent.runner import agent_run, context_read
    from apps.approvals.models import ApprovalRequest
    from apps.approvals.services import approval_decide
    from apps.outbox.dispatch import outbox_dispatch_batch
    from apps.tasks.models import Task
    from apps.tasks.services import task_cancel, task_submit

    seeded = tenant_seed(SLUG, devices=3, auto_approve=False, kb=True)
    users = get_user_model().objects
    requester = principal_for_user(users.get(username=seeded.users["requester"]))
    approver = principal_for_user(users.get(username=seeded.users["approver"]))

    def drive(task_id: uuid.UUID) -> Task:
        for _ in range(12):
            agent_run(task_id=task_id)
            context_read(task_id=task_id)
            outbox_dispatch_batch()
        return Task.objects.get(pk=task_id)

    def submit(i: int) -> Task:
        return task_submit(principal=requester, device_id=seeded.devices[i], symptom=SYMPTOMS[i],
                           urgency="high").task

    completed = drive(submit(0).pk)
    approval = ApprovalRequest.objects.get(task=completed, status="PENDING")
    approval_decide(principal=approver, approval_id=approval.pk, decision="approve", reason="bench")
    completed = drive(completed.pk)
    cancelled = submit(1)
    task_cancel(principal=requester, task_id=cancelled.pk, reason="bench")
    cancelled = drive(cancelled.pk)
    waiting = drive(submit(2).pk)
    got = (completed.status, cancelled.status, waiting.status)
    if got != ("COMPLETED", "CANCELLED", "WAITING_APPROVAL"):
        raise SystemExit(f"retention: the template tasks ended {got}")
    return [completed, cancelled, waiting]


def run(bench: Bench, *, history: int = 100_000, budget: float = 60.0) -> None:
    """Seed (see the module), purge until done, print the figures (nothing asserted)."""
    from unittest import mock

    from django.db import connection
    from django.utils import timezone

    from apps.retention.purge import purge_run
    from apps.tasks.models import Task
    from apps.tasks.replay import task_replay
    from tools.bench.history import clone_history

    bench.start_refservice()
    started = time.monotonic()
    with mock.patch("apps.core.queue.send_now", lambda name, *args: None):
        templates = _templates(bench)
    copies = max(1, (history - 3) // 3)
    ages = [400 * i / copies for i in range(copies)]
    done = 0
    step = 5_000
    while done < copies:  # in slices, so that memory stays flat
        n = min(step, copies - done)
        clone_history(templates, n, ages[done:done + n], now=timezone.now(), first=done)
        done += n
    tasks = Task.objects.count()
    bench.figure("retention.history_tasks", tasks, "tasks")
    bench.figure("retention.seed_s", round(time.monotonic() - started, 1), "s")
    _vacuum()
    before = _sizes()
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM events_taskevent")
        events = cur.fetchone()[0]
    bench.figure("retention.history_events", events, "events")
    for table, size in sorted(before.items()):
        bench.figure(f"retention.table_bytes.before.{table}", size, "bytes")

    runs, totals = [], {}
    while not runs or not runs[-1].complete:
        t0 = time.monotonic()
        run_ = purge_run(time_budget_seconds=budget)
        seconds = time.monotonic() - t0
        runs.append(run_)
        rows = sum(c["rows"] for c in run_.tables.values())
        freed = sum(c["bytes"] for c in run_.tables.values())
        bench.figure(f"retention.run{len(runs)}.seconds", round(seconds, 1), "s",
                     note=f"{'complete' if run_.complete else 'stopped at its budget'}; tasks {run_.tasks}")
        bench.figure(f"retention.run{len(runs)}.rows", rows, "rows", note=f"{freed:,} bytes")
        for table, c in run_.tables.items():
            t = totals.setdefault(table, {"rows": 0, "bytes": 0})
            t["rows"] += c["rows"]
            t["bytes"] += c["bytes"]
        if len(runs) > 200:
            raise SystemExit("retention: 200 purge runs did not reach the end")
    for table, t in sorted(totals.items()):
        bench.figure(f"retention.purged.{table}", t["rows"], "rows", note=f"{t['bytes']:,} bytes of column data")
    _vacuum()
    after = _sizes()
    _vacuum(full=True)
    full = _sizes()
    for table in sorted(before):
        bench.figure(f"retention.table_bytes.after.{table}", after.get(table, 0), "bytes",
                     note=f"after VACUUM FULL {full.get(table, 0):,}")
    sample = list(Task.objects.order_by("?")[:200])
    results = [task_replay(t) for t in sample]
    bad = [r for r in results if not r.ok]
    bench.figure("retention.replay_sample", len(sample), "tasks",
                 note=f"{sum(1 for r in results if r.purged)} purged, {len(bad)} divergent")
    if bad:
        raise SystemExit(f"retention: tasks diverge after the purge: {bad[:3]}")
