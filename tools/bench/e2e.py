"""Phase 3, end to end: N reports through the whole main job — the HTTP API (gunicorn), the agent,
retrieval with the local embedding model, the local drafter, the auto-approval policy, the outbox
dispatcher and the reference ticket service — with one Celery worker node of 1, 2 and 4 pool
processes serving every queue, and beat.

Per worker count: tasks/s (first acceptance to last terminal event), p50/p95 latency from the
request's acceptance to its receipt, writing commits per task, and the ratios to the floor and to
the ceiling's share per task (``ceiling ÷ commits per task``)."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import psycopg

from config import embedded
from tools.bench.harness import (
    BENCH_DIR,
    DATABASE,
    REDIS_DB,
    Bench,
    SqlStatements,
    WalCommits,
    percentile,
    session_client,
)
from tools.bench.seed import SYMPTOMS, tenant_seed

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
#: Reports sent one at a time after the measured burst, for the latency of a task that waits for
#: nobody (not counted in tasks/s or commits).
UNLOADED = 8
#: warm-up reports at least: enough that each web process (2, by accept order) and each pool process
#: has served some before the measured part (a first request imports Celery's result backends and
#: such, a first retrieval loads the embedding model)
WARM_MIN = 16

_LATENCY_SQL = """
SELECT t.status,
       extract(epoch FROM t.created_at),
       (SELECT extract(epoch FROM min(e.recorded_at)) FROM events_taskevent e
         WHERE e.task_id = t.id AND e.type = 'receipt.recorded'),
       (SELECT extract(epoch FROM max(e.recorded_at)) FROM events_taskevent e
         WHERE e.task_id = t.id AND e.type IN ('task.completed', 'task.failed', 'cancel.requested'))
FROM tasks_task t WHERE t.id = ANY(%s)
"""


def submit_all(base: str, username: str, devices: list[int], n: int, *, prefix: str, threads: int = 8,
               clients: list | None = None) -> list[str]:
    """POST ``n`` reports to ``/api/tasks/`` from ``threads`` logged-in sessions, each with its own
    Idempotency-Key and device; returns the accepted task ids. ``clients``: sessions logged in
    before (one per thread, kept open), so that signing in — a password hash each, about 0.3 s of
    the web's CPU — is not counted as the reports' cost. SystemExit on a refusal."""
    own = clients is None
    clients = clients if clients is not None else [session_client(base, username) for _ in range(threads)]
    threads = len(clients)

    def one(i: int) -> str:
        client = clients[i % threads]
        body = {"device_id": devices[i], "symptom": SYMPTOMS[i % len(SYMPTOMS)], "urgency": "high"}
        why = ""
        for _attempt in range(5):
            try:
                resp = client.post("/api/tasks/", json=body, headers={"Idempotency-Key": f"{prefix}-{i}"})
            except httpx.TransportError as exc:
                # A kept-alive connection the web server closed while the session sat idle (gunicorn
                # drops idle ones after 2 s): resent with the same Idempotency-Key, so at most one task.
                why = repr(exc)
                continue
            if resp.status_code in (200, 201):
                return resp.json()["id"]
            why = f"HTTP {resp.status_code} {resp.text[:300]}"
            time.sleep(0.5)
        raise SystemExit(f"report {prefix}-{i} refused: {why}")

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        ids = list(pool.map(one, range(n)))
    if own:
        for c in clients:
            c.close()
    return ids


def _own_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process so far, all its threads."""
    t = os.times()
    return t.user + t.system


def wait_terminal(conn, ids: list[str], *, timeout: float, alive=None) -> int:
    """Wait until every task in ``ids`` is terminal (or ``timeout`` s); returns how many are.
    ``alive()``, when given, is asked each round: a worker that died ends the wait with
    SystemExit instead of a long wait for nothing."""
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise SystemExit(f"a bench process exited while {len(ids) - done} tasks were still running; "
                             "see var/bench/logs/")
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM tasks_task WHERE id = ANY(%s) AND status = ANY(%s)",
                        [ids, list(TERMINAL)])
            done = cur.fetchone()[0]
        if done == len(ids):
            return done
        time.sleep(0.25)
    return done


#: the process roles whose CPU the run measures (with ``postgres``, the database server)
ROLES = ("web", "worker", "beat", "refservice")


def run_one(bench: Bench, conn, *, workers: int, n: int, profile: bool = False) -> dict:
    """One end-to-end run with a worker node of ``workers`` processes; returns its figures. With
    ``profile``, py-spy samples the worker processes during the measured part
    (``var/bench/profile-e2e-<W>w.txt``) and the per-function shares are printed."""
    import redis

    redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=REDIS_DB).flushdb()
    warm_n = max(2 * workers, WARM_MIN)
    seeded = tenant_seed(f"e2e-{workers}w", devices=n + warm_n + UNLOADED)
    base = f"http://127.0.0.1:{bench.ports['web']}"
    bench.start_web()
    bench.start_beat()
    bench.start_worker(workers)

    def alive() -> bool:
        return all(bench.procs[name].poll() is None for name in ("worker", "web", "beat", "refservice"))

    try:
        # Warm-up, not measured: each pool process loads the embedding model on its first retrieval,
        # each web process imports what its first report needs.
        warm = submit_all(base, seeded.users["requester"], seeded.devices[n:], warm_n, prefix=f"warm-{workers}")
        if wait_terminal(conn, warm, timeout=180, alive=alive) < len(warm):
            raise SystemExit(f"e2e with {workers} worker processes: the warm-up tasks did not end in 180 s")
        sampler = None
        if profile:
            from tools.bench.profile import Sampler

            sampler = Sampler(bench.procs["worker"].pid, BENCH_DIR / f"profile-e2e-{workers}w.txt")
            web_sampler = Sampler(bench.procs["web"].pid, BENCH_DIR / f"profile-e2e-{workers}w-web.txt")
        # The requesters sign in before the measured part: a sign-in is a session's cost, not a report's.
        sessions = [session_client(base, seeded.users["requester"]) for _ in range(8)]
        wal = WalCommits(conn)
        wal.start()
        cpu_before = bench.cpu_seconds(ROLES)
        loadgen_before = _own_cpu_seconds()
        started = time.time()
        ids = submit_all(base, seeded.users["requester"], seeded.devices[:n], n, prefix=f"e2e-{workers}",
                         clients=sessions)
        submitted = time.time() - started
        done = wait_terminal(conn, ids, timeout=max(300, n * 2), alive=alive)
        cpu_after = bench.cpu_seconds(ROLES)
        loadgen = _own_cpu_seconds() - loadgen_before
        commits, _ = wal.stop()
        if sampler is not None:
            sampler.stop()
            web_sampler.stop()
        # Service latency without a queue: a few reports one at a time, each after the last ended.
        # SQL statements per task are counted here, where logging each one slows nothing measured.
        alone, statements, control = [], 0, 0
        if done == n:  # a run that fell short stops below; nothing more to measure
            sql = SqlStatements(conn)
            sql.start()
            try:
                for i in range(UNLOADED):
                    alone += submit_all(base, seeded.users["requester"], [seeded.devices[n + warm_n + i]], 1,
                                        prefix=f"alone-{workers}-{i}", clients=sessions[:1])
                    wait_terminal(conn, alone[-1:], timeout=60)
            finally:
                statements, control = sql.stop()
        for client in sessions:
            client.close()
        bench.note_peak("worker", "worker")
        bench.note_peak("web", "web")
    finally:
        for name in ("worker", "beat", "web"):
            bench.stop(name)
    if done < n:
        raise SystemExit(f"e2e with {workers} worker processes: only {done} of {n} tasks ended in time; "
                         f"see {BENCH_DIR / 'logs'}")
    if profile:
        from tools.bench.profile import report

        report(BENCH_DIR / f"profile-e2e-{workers}w.txt", top=30)
        report(BENCH_DIR / f"profile-e2e-{workers}w-web.txt", top=30, label="web")
    with conn.cursor() as cur:
        cur.execute(_LATENCY_SQL, [ids])
        rows = cur.fetchall()
    if alone:
        with conn.cursor() as cur:
            cur.execute(_LATENCY_SQL, [alone])
            unloaded = [float(r[2]) - float(r[1]) for r in cur.fetchall() if r[2] is not None]
    else:
        unloaded = []
    completed = [r for r in rows if r[0] == "COMPLETED"]
    first = min(float(r[1]) for r in rows)
    last = max(float(r[3]) for r in rows if r[3] is not None)
    latencies = [float(r[2]) - float(r[1]) for r in rows if r[2] is not None]
    return {
        "tasks": n, "terminal": done, "completed": len(completed), "submit_seconds": submitted,
        "tasks_per_s": n / (last - first), "wall_seconds": last - first,
        "p50_s": percentile(latencies, 50), "p95_s": percentile(latencies, 95),
        "commits_per_task": commits / n,
        # SQL per task over the reports sent alone; CPU per role over the measured part, per task
        "sql_per_task": statements / len(alone) if alone else float("nan"),
        "sql_control_per_task": control / len(alone) if alone else float("nan"),
        "cpu_ms_per_task": {role: (cpu_after[role] - cpu_before[role]) * 1000 / n
                            for role in cpu_after if role in cpu_before},
        "loadgen_cpu_ms_per_task": loadgen * 1000 / n,
        "unloaded_p50_s": percentile(unloaded, 50), "unloaded_max_s": max(unloaded, default=float("nan")),
    }


def run(bench: Bench, *, n: int = 500, worker_counts=(1, 2, 4), profile: bool = False) -> None:
    """Figures ``e2e.<W>w.*`` for each worker count ``W``; ``profile`` samples the first run."""
    conn = psycopg.connect(embedded.postgres_url(DATABASE), autocommit=True)
    bench.start_refservice()
    ceiling = bench.value("ceiling.commits_per_s")
    floor = bench.value("floor.flows_per_s")
    try:
        for w in worker_counts:
            r = run_one(bench, conn, workers=w, n=n, profile=profile and w == worker_counts[0])
            key = f"e2e.{w}w"
            bench.figure(f"{key}.tasks_per_s", r["tasks_per_s"], "tasks/s",
                         f"{r['completed']}/{n} completed, {r['terminal']} ended, in {r['wall_seconds']:.1f} s; "
                         f"submitting took {r['submit_seconds']:.1f} s")
            bench.figure(f"{key}.latency_p50", r["p50_s"], "s", "accepted → receipt recorded, all submitted at once")
            bench.figure(f"{key}.latency_p95", r["p95_s"], "s")
            bench.figure(f"{key}.unloaded_latency_p50", r["unloaded_p50_s"], "s",
                         f"accepted → receipt recorded for {UNLOADED} reports sent one at a time after the burst "
                         f"(max {r['unloaded_max_s']:.2f} s)")
            bench.figure(f"{key}.commits_per_task", r["commits_per_task"], "commits",
                         "commit records in the WAL per task: web + workers + beat")
            bench.figure(f"{key}.sql_statements_per_task", r["sql_per_task"], "statements",
                         f"SQL statements the server ran per task for the {UNLOADED} reports sent one at a time "
                         f"(web + workers + beat), plus {r['sql_control_per_task']:.1f} BEGIN/COMMIT/SAVEPOINT/"
                         "RELEASE/ROLLBACK")
            cpu = r["cpu_ms_per_task"]
            for role, ms in cpu.items():
                bench.figure(f"{key}.cpu_ms_per_task.{role}", ms, "ms",
                             "CPU (user + system) of the role's processes per task, submission to the last end"
                             if role == "web" else "")
            bench.figure(f"{key}.cpu_ms_per_task.total", sum(cpu.values()), "ms",
                         " + ".join(f"{role} {ms:.1f}" for role, ms in cpu.items()) + "; the load generator aside")
            bench.figure(f"{key}.loadgen_cpu_ms_per_task", r["loadgen_cpu_ms_per_task"], "ms",
                         "CPU of the bench process sending the reports and polling for their end, on the same "
                         "cores (not in the total)")
            if floor:
                bench.figure(f"{key}.ratio_to_floor", r["tasks_per_s"] / floor, "", "tasks/s ÷ floor flows/s")
            if ceiling:
                bound = ceiling / r["commits_per_task"]
                bench.figure(f"{key}.ratio_to_ceiling", r["tasks_per_s"] / bound, "",
                             f"tasks/s ÷ (ceiling ÷ commits per task = {bound:.1f} tasks/s)")
    finally:
        bench.stop("refservice")
        conn.close()
