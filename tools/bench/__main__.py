"""``python -m tools.bench``: see :mod:`tools.bench`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
from datetime import UTC, datetime

PHASES = ("ceiling", "floor", "e2e", "outbox", "reads", "retrieval", "pages", "retention")


def _machine() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115 - tiny file
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(next(line for line in open("/proc/meminfo").read().splitlines()  # noqa: SIM115
                          if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration):
        mem_kb = 0
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kb / 1024 / 1024, 1),
            "python": platform.python_version(), "kernel": platform.release()}


def _fresh_database(name: str) -> None:
    import pgserver

    from config import embedded

    server = pgserver.get_server(embedded.PGDATA, cleanup_mode=None)
    server.psql(f'SET client_min_messages = warning; DROP DATABASE IF EXISTS "{name}" WITH (FORCE);')
    server.psql(f'CREATE DATABASE "{name}";')


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _positives(text: str) -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]``; each at least 1, each once."""
    return list(dict.fromkeys(_positive(part.strip()) for part in text.split(",")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__)
    parser.add_argument("--only", action="append", choices=PHASES, help="run only this phase (repeatable)")
    parser.add_argument("--n", type=_positive, default=500, help="tasks per end-to-end run (default 500)")
    parser.add_argument("--workers", type=_positives, default=[1, 2, 4],
                        help="worker process counts, comma-separated (default 1,2,4)")
    parser.add_argument("--outbox-n", type=_positive, default=2000,
                        help="outbox messages to drain (default 2000: at 2,000 messages/s, 500 drained in a "
                             "quarter of a second, too short a window to measure)")
    parser.add_argument("--outbox-single", action="store_true",
                        help="the no-op remote answers no POST /ticket-batches: every new ticket goes alone "
                             "(what a ticket system without a batch endpoint gets)")
    parser.add_argument("--reads-n", type=_positive, default=20,
                        help="reports per path and condition in the reads phase (default 20: 80 measured, "
                             "about 90 s in all)")
    parser.add_argument("--slow-read", type=float, default=1.0,
                        help="seconds the ticket system takes to answer the open-ticket read in the reads phase's "
                             "slow cells (default 1.0; under REFSERVICE_TIMEOUT_SECONDS, 5)")
    parser.add_argument("--ticket-latency-ms", type=float, default=100.0,
                        help="the ticket system's base latency for each open-ticket read in the reads phase, at "
                             "the fault proxy (default 100: a hosted helpdesk tens to hundreds of ms away)")
    parser.add_argument("--chunks", type=_positives, default=[10000, 100000],
                        help="retrieval corpus sizes, comma-separated, growing (default 10000,100000)")
    parser.add_argument("--history", type=_positive, default=100_000,
                        help="tasks in the history the retention purge works through (default 100000)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy samples the workers in the first end-to-end run and the outbox drain")
    parser.add_argument("--profile-wall", action="store_true",
                        help="--profile, sampling every thread whether it runs or waits (shares of wall time)")
    parser.add_argument("--quick", action="store_true", help="shorter runs, for trying the bench out")
    args = parser.parse_args(argv)
    if args.profile_wall:
        from tools.bench import profile as profiling

        args.profile, profiling.WALL = True, True
    phases = args.only or list(PHASES)
    started = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")

    from config import embedded
    from tools.bench import harness

    shutil.rmtree(harness.LOG_DIR, ignore_errors=True)
    harness.LOG_DIR.mkdir(parents=True, exist_ok=True)
    embedded.ensure_postgres()
    embedded.ensure_redis()
    bench = harness.Bench(quick=args.quick)
    machine = _machine()
    print(f"• faultdesk bench on {machine['cpus']} cores ({machine['cpu']}), {machine['memory_gib']} GiB; "
          f"phases: {', '.join(phases)}", flush=True)

    # The in-process part (seeding, retrieval, direct measurements) uses the bench database too.
    os.environ.update({k: v for k, v in bench.env.items() if k.startswith(("DATABASE_", "REDIS_", "REFSERVICE_",
                                                                            "DJANGO_", "FAULTDESK_", "LOG_"))})
    _fresh_database(harness.DATABASE)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", "--no-input", verbosity=0)
    # SIGTERM/SIGHUP (a CI timeout, a closed terminal) stop the run like Ctrl-C: every process it
    # started is stopped and the figures measured so far are written.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    complete = False
    try:
        _run_phases(bench, phases, args)
        complete = True
    finally:
        bench.stop_all()
        _finish(bench, machine=machine, args=args, stamp=stamp, started=started, complete=complete)
    return 0


def _interrupted(signum, _frame):
    raise SystemExit(f"bench stopped by signal {signal.Signals(signum).name}")


def _run_phases(bench, phases, args) -> None:
    if "ceiling" in phases:
        from tools.bench import ceiling

        ceiling.run(bench, seconds=5 if args.quick else 20)
    if "floor" in phases:
        from tools.bench import floor

        floor.run(bench, seconds=5 if args.quick else 15)
    if "e2e" in phases:
        from tools.bench import e2e

        e2e.run(bench, n=args.n, worker_counts=args.workers, profile=args.profile)
    if "outbox" in phases:
        from tools.bench import outbox

        outbox.run(bench, n=args.outbox_n, profile=args.profile, batch_endpoint=not args.outbox_single)
    if "reads" in phases:
        from tools.bench import reads

        reads.run(bench, n=5 if args.quick else args.reads_n, slow_seconds=args.slow_read,
                  ticket_latency=args.ticket_latency_ms / 1000)
    if "retrieval" in phases:
        from tools.bench import retrieval

        retrieval.run(bench, sizes=args.chunks)
    if "pages" in phases:
        from tools.bench import pages

        pages.run(bench, requests=100)
    if "retention" in phases:
        from tools.bench import retention

        retention.run(bench, history=3_000 if args.quick else args.history)


def _finish(bench, *, machine: dict, args, stamp: str, started: float, complete: bool) -> None:
    """The memory figures, the summary and the JSON file — also after a failed or stopped run,
    marked ``"complete": false``, with what was measured before it stopped."""
    from tools.bench import harness

    roles = {"worker": "worker process (all queues, end to end)", "fill_worker": "worker process serving agent "
             "and tools (the outbox backlog's)", "outbox_worker": "worker process serving only the outbox queue",
             "web": "web (gunicorn) process"}
    for role, what in roles.items():
        if role in bench.peaks:
            bench.figure(f"memory.{role}_peak_rss", bench.peaks[role], "MiB",
                         f"largest peak RSS (VmHWM) of one {what} during the run")
    bench.figure("bench.elapsed", time.monotonic() - started, "s")
    _summary(bench)
    out = {"started_at": stamp, "finished_at": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"), "complete": complete,
           "machine": machine, "args": vars(args), "figures": bench.figures}
    path = harness.BENCH_DIR / f"bench-{stamp}.json"
    path.write_text(json.dumps(out, indent=2))
    (harness.BENCH_DIR / "latest.json").write_text(json.dumps(out, indent=2))
    print(f"• figures written to {path}" + ("" if complete else " (the run did not complete)"), flush=True)


def _summary(bench) -> None:
    v = bench.value

    def ratio(key: str) -> str:
        return "n/a" if v(key) is None else f"{v(key):.3f}"

    lines = ["", "summary"]
    if v("ceiling.commits_per_s"):
        lines.append(f"  ceiling   {v('ceiling.commits_per_s'):,.0f} commits/s (pgbench simple-update)")
    if v("floor.flows_per_s"):
        lines.append(f"  floor     {v('floor.flows_per_s'):,.1f} flows/s (the work alone, no durability layer)")
    counts = sorted({int(k.split(".")[1].removesuffix("w")) for k in bench.figures if k.startswith("e2e.")})
    for w in counts:
        e = f"e2e.{w}w."
        lines.append(
            f"  e2e {w}w    {v(e + 'tasks_per_s'):,.2f} tasks/s, p50 {v(e + 'latency_p50'):.2f} s, "
            f"p95 {v(e + 'latency_p95'):.2f} s (alone {v(e + 'unloaded_latency_p50') or 0:.2f} s), "
            f"{v(e + 'commits_per_task'):.1f} commits/task, {ratio(e + 'ratio_to_floor')} of floor, "
            f"{ratio(e + 'ratio_to_ceiling')} of ceiling")
        roles = [k.removeprefix(e + "cpu_ms_per_task.") for k in bench.figures
                 if k.startswith(e + "cpu_ms_per_task.") and not k.endswith(".total")]
        if roles:
            lines.append(f"            {v(e + 'sql_statements_per_task') or 0:.0f} SQL statements/task (alone); "
                         f"CPU per task {v(e + 'cpu_ms_per_task.total'):.1f} ms: "
                         + ", ".join(f"{role} {v(e + 'cpu_ms_per_task.' + role):.1f}" for role in roles)
                         + (f"; load generator {v(e + 'loadgen_cpu_ms_per_task'):.1f} aside"
                            if v(e + 'loadgen_cpu_ms_per_task') else ""))
    if v("outbox.messages_per_s"):
        lines.append(f"  outbox    {v('outbox.messages_per_s'):,.1f} messages/s, "
                     f"{v('outbox.commits_per_message'):.2f} commits/message, {ratio('outbox.ratio_to_ceiling')} "
                     "of ceiling")
        if v("outbox.settled_tasks_per_s"):
            lines.append(f"            then {v('outbox.settled_tasks_per_s'):,.1f} tasks/s settled by the agent "
                         "workers (receipt.recorded + task.completed)")
    for cond, what in (("slow", f"open-ticket read +{v('reads.slow_read_s') or 0:g} s"),
                       ("slow_retrieval", f"retrieval +{v('reads.slow_read_s') or 0:g} s"),
                       ("none", "no slow read")):
        if v(f"reads.{cond}.ratio_p50") is None:
            continue
        seq, par = (f"reads.sequential.{cond}.", f"reads.parallel.{cond}.")
        lines.append(f"  reads     {what}: sequential (reducer/5) p50 {v(seq + 'p50_ms'):,.0f} ms, p95 "
                     f"{v(seq + 'p95_ms'):,.0f} ms; parallel (reducer/6) p50 {v(par + 'p50_ms'):,.0f} ms, p95 "
                     f"{v(par + 'p95_ms'):,.0f} ms; parallel ÷ sequential p50 {v(f'reads.{cond}.ratio_p50'):.2f}, "
                     f"p95 {v(f'reads.{cond}.ratio_p95'):.2f}")
    stems = [k.removesuffix(".p95_ms") for k in bench.figures if k.startswith("retrieval.") and k.endswith(".p95_ms")]
    for stem in stems:  # in the order measured: 10k before 100k
        lines.append(f"  {stem:<28} p50 {v(stem + '.p50_ms'):.1f} ms, p95 {v(stem + '.p95_ms'):.1f} ms, "
                     f"recall@10 {v(stem + '.recall_at_10'):.3f}")
    for key in (k for k in bench.figures if k.startswith("pages.") and k.endswith(".p95_ms")):
        lines.append(f"  {key.removesuffix('.p95_ms'):<28} p95 {v(key):.0f} ms")
    for key in (k for k in bench.figures if k.startswith("memory.")):
        role = key.removeprefix("memory.").removesuffix("_peak_rss")
        lines.append(f"  memory    {role} peak RSS {v(key):,.0f} MiB")
    lines.append(f"  elapsed   {v('bench.elapsed'):,.0f} s")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
