"""Phase 4, outbox dispatch: how fast the dispatcher drains a backlog when the remote costs
nothing.

Stage 1 builds the backlog the real way: N reports go through the main job with workers serving
only the ``agent`` and ``tools`` queues, so every task stops with its ``ticket.create`` intent
committed and its outbox row ``PENDING``. Stage 2 starts a worker serving only ``outbox`` (two
processes, as ``make up`` runs it) against a no-op remote (:mod:`tools.bench.noop_remote`) and
measures messages/s from the first attempt to the last delivery, and writing commits per message."""

from __future__ import annotations

import sys
import time

import psycopg

from config import embedded
from tools.bench.e2e import submit_all
from tools.bench.harness import BENCH_DIR, DATABASE, REDIS_DB, Bench, WalCommits
from tools.bench.seed import tenant_seed

_PENDING_SQL = """
SELECT count(*) FILTER (WHERE o.status = 'PENDING'), count(*) FILTER (WHERE o.status = 'DELIVERED'), count(*)
FROM outbox_outboxmessage o JOIN actions_action a ON a.id = o.action_id WHERE a.task_id = ANY(%s)
"""
_SETTLED_SQL = """
WITH e AS (SELECT recorded_at FROM events_taskevent WHERE task_id = ANY(%s) AND type = 'receipt.recorded')
SELECT count(*), count(*) FILTER (WHERE recorded_at > (SELECT min(recorded_at) FROM e)),
       extract(epoch FROM min(recorded_at)), extract(epoch FROM max(recorded_at))
FROM e
"""
_WINDOW_SQL = """
SELECT extract(epoch FROM min(t.started_at)), extract(epoch FROM max(o.delivered_at))
FROM outbox_outboxmessage o JOIN actions_action a ON a.id = o.action_id
JOIN actions_actionattempt t ON t.action_id = a.id WHERE a.task_id = ANY(%s)
"""


def _counts(conn, ids) -> tuple[int, int, int]:
    with conn.cursor() as cur:
        cur.execute(_PENDING_SQL, [ids])
        return cur.fetchone()


def _settle(bench: Bench, conn, ids, n: int, env: dict, *, processes: int = 2):
    """Stage 3: the tasks' half of the drained receipts (the ``settle_receipts`` messages the drain
    sent, on the ``agent`` queue), run by a worker serving only ``agent``. Returns ``(tasks settled,
    seconds from the first to the last receipt.recorded, {role: CPU ms per task})``, or None when
    nothing was settled."""
    _backends_gone(conn, deadline=time.monotonic() + 30)
    wal = WalCommits(conn)
    wal.start()
    bench.start_worker(processes, queues="agent", name="worker-settle", env=env)

    def settled_so_far():
        with conn.cursor() as cur:
            cur.execute(_SETTLED_SQL, [ids])
            return cur.fetchone()

    deadline = time.monotonic() + max(120, n)
    # CPU is read from the first settlement on, so the worker's start-up is not counted.
    while settled_so_far()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    cpu_before, count_before = bench.cpu_seconds(["worker-settle"]), settled_so_far()[0]
    count, after_first, first, last = settled_so_far()
    while count < n and time.monotonic() < deadline:
        time.sleep(0.25)
        count, after_first, first, last = settled_so_far()
    cpu_after = bench.cpu_seconds(["worker-settle"])
    commits, _ = wal.stop()
    bench.stop("worker-settle")
    if not count or count <= count_before:
        return None
    cpu = {role: (cpu_after[role] - cpu_before.get(role, 0.0)) * 1000 / (count - count_before)
           for role in ("worker-settle", "postgres") if role in cpu_after}
    # The first batch's events share one commit time: the window starts there and counts the rest.
    return count, after_first, float(last) - float(first), cpu, commits / count


def _backends_gone(conn, *, deadline: float) -> None:
    """Wait until no backend but ``conn``'s is connected to the bench database (or ``deadline``);
    this process's own Django connection (the seeding's) is closed first."""
    from django.db import connections

    connections.close_all()
    while time.monotonic() < deadline:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND backend_type = 'client backend'")
            if cur.fetchone()[0] == 0:
                return
        time.sleep(0.1)
    print("  outbox: backends of the previous stage still connected after 30 s; PostgreSQL's CPU figure "
          "may count some of their work", flush=True)


def run(bench: Bench, *, n: int = 2000, dispatchers: int = 2, profile: bool = False,
        batch_endpoint: bool = True) -> None:
    """Figures ``outbox.*``, with CPU milliseconds per message of the dispatcher processes, the
    no-op remote and PostgreSQL. With ``profile``, py-spy samples the dispatcher processes while
    they drain (``var/bench/profile-outbox.txt``). ``batch_endpoint`` False: the no-op remote
    answers ``POST /ticket-batches`` with 404, so every new ticket is sent alone. SystemExit when
    the backlog cannot be built or does not drain."""
    import redis

    redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=REDIS_DB).flushdb()
    conn = psycopg.connect(embedded.postgres_url(DATABASE), autocommit=True)
    env = {**bench.env, "REFSERVICE_URL": f"http://127.0.0.1:{bench.ports['noop']}"}
    seeded = tenant_seed("outbox", devices=n)
    bench.start("noop-remote", [sys.executable, "-m", "tools.bench.noop_remote", "--port", str(bench.ports["noop"]),
                                *([] if batch_endpoint else ["--no-batch"])])
    bench.wait_http(f"http://127.0.0.1:{bench.ports['noop']}/healthz", 30)
    try:
        # Stage 1: the backlog, through the main job up to the committed intent.
        bench.start_web(env=env)
        # the backlog is for the dispatcher: the runs must not deliver their new tickets themselves
        bench.start_worker(2, queues="agent,tools", name="worker-fill",
                           env={**env, "FAULTDESK_OUTBOX_DIRECT_DELIVERY": "false"})
        started = time.monotonic()
        ids = submit_all(f"http://127.0.0.1:{bench.ports['web']}", seeded.users["requester"], seeded.devices, n,
                         prefix="outbox")
        deadline = time.monotonic() + max(300, 2 * n)
        while _counts(conn, ids)[0] < n and time.monotonic() < deadline:
            time.sleep(0.5)
        pending, _, total = _counts(conn, ids)
        bench.note_peak("fill_worker", "worker-fill")
        bench.stop("worker-fill")
        bench.stop("web")
        if pending < n:
            raise SystemExit(f"outbox: only {pending} of {n} messages became pending ({total} rows); see logs")
        print(f"  outbox backlog of {n} built in {time.monotonic() - started:.0f} s", flush=True)
        # The stopped processes' backends end after them, and the postmaster counts each one's whole
        # life's CPU when it reaps it: were that inside the drain's window, the stage's PostgreSQL
        # work would be counted as the drain's.
        _backends_gone(conn, deadline=time.monotonic() + 30)
        # Stage 2: drain it.
        wal = WalCommits(conn)
        wal.start()
        bench.start_worker(dispatchers, queues="outbox", name="worker-outbox", env=env)
        # CPU is read from the first claim on, so the processes' start-up is not counted.
        while _counts(conn, ids)[0] == n and time.monotonic() < started + max(300, 2 * n) + 120:
            time.sleep(0.02)
        cpu_before, delivered_before = bench.cpu_seconds(["noop-remote", "worker-outbox"]), _counts(conn, ids)[1]
        sampler = None
        if profile:
            from tools.bench.profile import Sampler

            sampler = Sampler(bench.procs["worker-outbox"].pid, BENCH_DIR / "profile-outbox.txt")
        deadline = time.monotonic() + max(120, n)
        while _counts(conn, ids)[1] < n and time.monotonic() < deadline:
            time.sleep(0.25)
        commits, _ = wal.stop()
        cpu_after = bench.cpu_seconds(["noop-remote", "worker-outbox"])
        if sampler is not None:
            sampler.stop()
        bench.note_peak("outbox_worker", "worker-outbox")
        bench.stop("worker-outbox")
        # Stage 3 only after a whole drain (otherwise the phase stops below).
        settled = _settle(bench, conn, ids, n, env) if _counts(conn, ids)[1] >= n else None
    finally:
        bench.stop("noop-remote")
    _, delivered, _ = _counts(conn, ids)
    if delivered < n:
        conn.close()
        raise SystemExit(f"outbox: only {delivered} of {n} messages were delivered in time; see the logs")
    with conn.cursor() as cur:
        cur.execute(_WINDOW_SQL, [ids])
        first, last = (float(x) for x in cur.fetchone())
    conn.close()
    rate = delivered / (last - first)
    per_message = commits / max(1, delivered)
    bench.figure("outbox.messages_per_s", rate, "messages/s",
                 f"{delivered}/{n} delivered in {last - first:.1f} s by {dispatchers} dispatcher processes, "
                 f"no-op remote, {'new tickets in batch requests' if batch_endpoint else 'every request alone'}")
    bench.figure("outbox.commits_per_message", per_message, "commits",
                 "commit records in the WAL per delivered message")
    # The dispatcher processes started inside the window: all of their CPU is the drain's.
    for role in ("worker-outbox", "noop-remote", "postgres"):
        if role in cpu_after:
            used = cpu_after[role] - cpu_before.get(role, 0.0)
            bench.figure(f"outbox.cpu_ms_per_message.{role.split('-')[0]}",
                         used * 1000 / max(1, delivered - delivered_before), "ms",
                         f"CPU of the {role} processes from the first claim to the last delivery, per message")
    if settled is not None:
        count, after_first, seconds, cpu, settle_commits = settled
        bench.figure("outbox.settled_tasks_per_s", after_first / max(seconds, 1e-9), "tasks/s",
                     f"{count}/{n} tasks' receipt.recorded + task.completed appended in {seconds:.1f} s by "
                     f"{dispatchers} agent processes after the drain (the settlement the drain leaves to them)")
        bench.figure("outbox.settle_commits_per_task", settle_commits, "commits",
                     "commit records in the WAL per task settled in the third stage")
        for role, ms in cpu.items():
            bench.figure(f"outbox.settle_cpu_ms_per_task.{role.split('-')[0]}", ms, "ms",
                         f"CPU of the {role} processes while they settled the drained receipts, per task")
    if profile:
        from tools.bench.profile import report

        report(BENCH_DIR / "profile-outbox.txt")
    if ceiling := bench.value("ceiling.commits_per_s"):
        bound = ceiling / per_message
        bench.figure("outbox.ratio_to_ceiling", rate / bound, "",
                     f"messages/s ÷ (ceiling ÷ commits per message = {bound:.0f} messages/s)")
