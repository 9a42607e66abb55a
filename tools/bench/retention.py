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
- ``retention.hot_path.<op>.<idle|purging>.{p50_ms,p95_ms,max_ms}``: the hot path's latency with
  the purge idle (``IDLE_SECONDS`` before it starts) and while its runs work through the history. A
  probe process (spawned: its own interpreter and database connection, as a web or worker process
  has; the purge runs in the bench's own process) files a report through the service layer
  (``submit``: :func:`apps.tasks.services.task_submit`, the task row and its first event) and
  cancels it (``cancel``: an event appended to that open task through the store's CAS), again and
  again with a pause of ``PROBE_PAUSE_SECONDS``; each operation is timed on its own;
- the replay of a sample of 200 tasks after the purge (ok or purged, never divergent).
"""

from __future__ import annotations

import time
import uuid

from tools.bench.harness import Bench, percentile
from tools.bench.seed import SYMPTOMS, tenant_seed

SLUG = "retention"
#: how long the hot path is timed before the purge starts
IDLE_SECONDS = 20.0
#: the probe's pause between two rounds (a report filed and cancelled)
PROBE_PAUSE_SECONDS = 0.02
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


def _probe_main(samples, stop, username: str, device_id: int, pause: float) -> None:
    """The probe process (spawned): Django on a connection of its own, then rounds of a report filed
    for ``device_id`` as ``username`` (``submit``) and cancelled (``cancel``) until ``stop`` is set,
    each operation put on ``samples`` as ``(wall time, op, ms)``; ``None`` last (or the error text)."""
    import django

    django.setup()
    from unittest import mock

    from django.contrib.auth import get_user_model

    from apps.accounts.principal import principal_for_user
    from apps.tasks.services import task_cancel, task_submit

    try:
        requester = principal_for_user(get_user_model().objects.get(username=username))
        with mock.patch("apps.core.queue.send_now", lambda name, *args: None):
            while not stop.is_set():
                t0 = time.perf_counter()
                task = task_submit(principal=requester, device_id=device_id,
                                   symptom="Probe: the panel shows E-203 after warm-up.", urgency="low").task
                t1 = time.perf_counter()
                task_cancel(principal=requester, task_id=task.pk, reason="probe")
                t2 = time.perf_counter()
                samples.put((time.time(), "submit", (t1 - t0) * 1000))
                samples.put((time.time(), "cancel", (t2 - t1) * 1000))
                stop.wait(pause)
    except Exception as exc:  # noqa: BLE001 - reported by the phase
        samples.put(f"{type(exc).__name__}: {exc}")
    samples.put(None)


class _Probe:
    """The hot path timed in a process of its own (its own interpreter and database connection, as
    a web or worker process is: the purge's Python work does not hold its GIL), from
    :meth:`start` to :meth:`finish`, which returns every sample as ``(wall time, op, ms)``."""

    OPS = ("submit", "cancel")

    def __init__(self, username: str, device_id: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.samples, self.stop = ctx.Queue(), ctx.Event()
        self.process = ctx.Process(target=_probe_main, name="retention-probe", daemon=True,
                                   args=(self.samples, self.stop, username, device_id, PROBE_PAUSE_SECONDS))

    def start(self) -> None:
        """Start the probe and return once its first operation was timed (its Django is up)."""
        self.process.start()
        self.first = [self._next(timeout=120)]

    def _next(self, timeout: float):
        item = self.samples.get(timeout=timeout)
        if isinstance(item, str):
            raise SystemExit(f"retention: the hot-path probe failed: {item}")
        return item

    def finish(self) -> list[tuple[float, str, float]]:
        self.stop.set()
        out = [x for x in self.first if x is not None]
        if self.first[-1] is not None:
            while (item := self._next(timeout=120)) is not None:
                out.append(item)
        self.process.join(30)
        return out


def _window(samples, since: float, until: float) -> dict[str, list[float]]:
    """The samples taken in ``[since, until)`` (wall time), per operation."""
    out: dict[str, list[float]] = {op: [] for op in _Probe.OPS}
    for at, op, ms in samples:
        if since <= at < until:
            out[op].append(ms)
    return out


def _latency_figures(bench: Bench, window: str, samples: dict[str, list[float]], seconds: float) -> None:
    for op, values in samples.items():
        name = f"retention.hot_path.{op}.{window}"
        note = f"{len(values)} in {seconds:.0f} s"
        bench.figure(f"{name}.p50_ms", percentile(values, 50), "ms", note=note)
        bench.figure(f"{name}.p95_ms", percentile(values, 95), "ms")
        bench.figure(f"{name}.max_ms", max(values, default=float("nan")), "ms")


def _templates(bench: Bench):
    """The three template tasks (completed, cancelled, waiting for approval), driven in-process,
    and the requester and a device the hot-path probe files its reports with."""
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
    return [completed, cancelled, waiting], seeded.users["requester"], seeded.devices[2]


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
        templates, probe_user, probe_device = _templates(bench)
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

    # the hot path, timed from another process: first with the purge idle, then while it runs
    probe = _Probe(probe_user, probe_device)
    probe.start()
    idle_since = time.time()
    time.sleep(IDLE_SECONDS)
    purging_since = time.time()
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
            probe.finish()
            raise SystemExit("retention: 200 purge runs did not reach the end")
    purging_until = time.time()
    samples = probe.finish()
    _latency_figures(bench, "idle", _window(samples, idle_since, purging_since), purging_since - idle_since)
    _latency_figures(bench, "purging", _window(samples, purging_since, purging_until), purging_until - purging_since)
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
