"""Phase ``reads``: how much the parallel context reads of ``reducer/6`` (the open-ticket read an
activity of its own on the ``tools`` queue, the device read and retrieval in the run that dispatches
it) cut the time to the proposal when one read is slow, against the same three reads one after the
other (``reducer/5``), with everything else equal.

Each read has a realistic cost: the tenant's knowledge base is the project's whole one (every scope,
English and Chinese), and the ticket system answers each open-ticket read after a base latency
(:data:`TICKET_LATENCY_S` by default, a hosted helpdesk's distance) at the fault proxy.

The stack is the end-to-end phase's (:mod:`tools.bench.e2e`): one Celery worker node serving
``agent,tools,outbox`` with :data:`CONCURRENCY` prefork processes (so the three reads of a report
can run side by side on the ``tools`` queue, with a slot to spare; its Celery app is
:mod:`tools.bench.reads_worker`'s, which can make retrieval slow), beat, the reference ticket service
— here behind the fault proxy (``tools/faultproxy.py``), which delays the ticket system's reads — and
two webs (gunicorn, one process of 4 threads each), each pinning the reducer version of the tasks it
accepts (:mod:`tools.bench.pinned_wsgi`): ``reducer/6`` on one, ``reducer/5`` on the other, whichever
version new tasks get in this build.

1. **Seeding**, not measured: one report per device through each web, auto-approved, so that every
   device has an open ticket that faultdesk created. The open-ticket read only asks the ticket
   system about such a ticket; without one it makes no call and nothing could be slow. These reports
   also warm every pool process (the embedding model) and both webs.
2. **Measured**: ``n`` rounds; each sends one report of each cell — sequential or parallel reads,
   times three conditions: ``none`` (every read at its base cost), ``slow`` (the ticket system's
   open-ticket read, ``GET /tickets/<id>``, ``slow_seconds`` slower), ``slow_retrieval``
   (retrieval ``slow_seconds`` slower) — in a shuffled order, one at a time: the next is sent once the last one has
   proposed, so no report waits for another. The policy asks an approval for a comment, so each
   stops at ``approval.requested`` with nothing running after it.

**Time to the proposal** is read from the events' times: ``task.accepted`` to the first
``approval.requested`` or ``intent.committed`` (:func:`time_to_proposal`). Where it goes
(:func:`proposal_spans`): to the first step a worker records, through the reads (to the last read's
event), then the draft, validation and policy.
"""

from __future__ import annotations

import os
import random
import sys
import time

import httpx
import psycopg

from config import embedded
from tools.bench.e2e import submit_all, wait_terminal
from tools.bench.harness import (
    BENCH_DIR,
    BIN,
    DATABASE,
    LOG_DIR,
    REDIS_DB,
    Bench,
    free_port,
    percentile,
    session_client,
)
from tools.bench.reads_worker import SLOW_RETRIEVAL_FILE
from tools.bench.seed import tenant_seed

#: prefork processes of the worker node (every queue): three reads side by side and one to spare
CONCURRENCY = 4
#: the two ways of reading, by the reducer version their tasks are pinned to
PATHS = {"sequential": "reducer/5", "parallel": "reducer/6"}
#: the ticket system's reads the proxy delays: the open-ticket read (``GET /tickets/<id>``)
SLOW_PREFIX = "/tickets/"
#: the ticket system's base latency for a read (seconds): a hosted helpdesk tens to hundreds of ms away
TICKET_LATENCY_S = 0.1
#: the conditions, by the read made slow (None: none is)
SLOWED = {"none": None, "slow": "ticket", "slow_retrieval": "retrieval"}
ACCEPTED = "task.accepted"
#: the events that end the time to the proposal: an approval asked, or an intent committed without one
PROPOSAL_EVENTS = ("approval.requested", "intent.committed")
#: the events that record a context read (the same three in both versions)
READ_EVENTS = ("device.read", "ticket.read", "evidence.retrieved")
#: the statuses before the proposal
BEFORE_PROPOSAL = ("ACCEPTED", "RETRIEVING", "PROPOSING", "VALIDATING")


def time_to_proposal(events) -> float | None:
    """Seconds from ``task.accepted`` to the first proposal event (``approval.requested`` or
    ``intent.committed``) of one task's ``events`` (``(type, seconds)`` pairs, in any order); None
    without both."""
    accepted = min((at for etype, at in events if etype == ACCEPTED), default=None)
    proposed = min((at for etype, at in events if etype in PROPOSAL_EVENTS), default=None)
    if accepted is None or proposed is None:
        return None
    return proposed - accepted


def proposal_spans(events) -> dict | None:
    """Where one task's time to the proposal went (seconds), from its ``events`` (``(type,
    seconds)``): ``start`` — acceptance to the first event a worker recorded (the queue's hop, the
    lease claim); ``reads`` — from there to the last read's event (``device.read``, ``ticket.read``,
    ``evidence.retrieved``); ``after`` — from there to the proposal (draft, validation, policy).
    Only events up to the proposal count. None without an acceptance, a read and a proposal."""
    total = time_to_proposal(events)
    if total is None:
        return None
    accepted = min(at for etype, at in events if etype == ACCEPTED)
    proposed = accepted + total
    before = [(etype, at) for etype, at in events if accepted < at <= proposed and etype != ACCEPTED]
    reads = [at for etype, at in before if etype in READ_EVENTS]
    if not reads:
        return None
    first, last_read = min(at for _, at in before), max(reads)
    return {"total": total, "start": first - accepted, "reads": last_read - first, "after": proposed - last_read}


def report_waits(events) -> dict | None:
    """The parallel path's waits, from one ``reducer/6`` task's ``events`` (``(type, seconds,
    read_done)``, ``read_done`` the time a read event's payload says its read finished, else None):
    ``local`` — the dispatch's last ``budget.reserved`` to the last local read's event (the device
    read and retrieval done and reported in the dispatching run); ``hop`` — that reservation to the
    open-ticket read finished (the ``read_step`` message's way to a pool process, the task row read,
    and the read itself with the ticket system's latency); ``report`` — the open-ticket read finished
    to its event recorded (taking the task's lease, while the dispatching run may still hold it, and
    recording). None without a ticket read that says when it finished."""
    ticket = [(at, finished) for etype, at, finished in events if etype == "ticket.read" and finished is not None]
    if not ticket:
        return None
    recorded, finished = min(ticket)
    reserved = [at for etype, at, _ in events if etype == "budget.reserved" and at < recorded]
    if not reserved:
        return None
    dispatched = max(reserved)
    local = [at for etype, at, _ in events if etype in ("device.read", "evidence.retrieved") and at > dispatched]
    return {"local": (max(local) - dispatched) if local else None, "hop": finished - dispatched,
            "report": recorded - finished}


def cell_summary(samples: list[float]) -> dict:
    """``{"n", "p50", "p95"}`` of ``samples`` (seconds)."""
    return {"n": len(samples), "p50": percentile(samples, 50), "p95": percentile(samples, 95)}


# --- the run --------------------------------------------------------------------------------------

def _events(conn, ids: list[str]) -> dict[str, list[tuple[str, float, float | None]]]:
    """``{task id: [(type, recorded, read finished or None)]}``, times in seconds since the epoch."""
    out: dict[str, list[tuple[str, float, float | None]]] = {i: [] for i in ids}
    with conn.cursor() as cur:
        cur.execute("SELECT task_id::text, type, extract(epoch FROM recorded_at)::float8, "
                    "extract(epoch FROM coalesce(payload->>'read_at', payload->>'retrieved_at')::timestamptz)::float8 "
                    "FROM events_taskevent WHERE task_id = ANY(%s::uuid[])", [ids])
        for task_id, etype, at, finished in cur.fetchall():
            out[task_id].append((etype, at, finished))
    return out


def _wait_proposed(conn, task_id: str, *, timeout: float, alive) -> str:
    """Poll until ``task_id`` is past its proposal (or ended); returns its status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with conn.cursor() as cur:
            cur.execute("SELECT status FROM tasks_task WHERE id = %s", [task_id])
            status = cur.fetchone()[0]
        if status not in BEFORE_PROPOSAL:
            return status
        if not alive():
            raise SystemExit(f"a bench process exited while task {task_id} was still before its proposal; "
                             f"see {LOG_DIR}")
        time.sleep(0.02)
    raise SystemExit(f"task {task_id} did not propose within {timeout:.0f} s; see {LOG_DIR}")


def _start_web(bench: Bench, name: str, port: int, env: dict, app: str) -> None:
    bench.start(name, [str(BIN / "gunicorn"), app, "-b", f"127.0.0.1:{port}", "-w", "1", "--threads", "4",
                       "--timeout", "120"], env=env)


def run(bench: Bench, *, n: int = 20, slow_seconds: float = 1.0, ticket_latency: float = TICKET_LATENCY_S,
        seed: int = 7) -> None:
    """Figures ``reads.*``: time to the proposal, p50/p95, of ``n`` reports per path (sequential,
    parallel) and condition (:data:`SLOWED`: no slow read; the open-ticket read ``slow_seconds``
    slower; retrieval ``slow_seconds`` slower), every open-ticket read answered after
    ``ticket_latency`` seconds more, and the ratios parallel ÷ sequential."""
    import redis

    redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=REDIS_DB).flushdb()
    conn = psycopg.connect(embedded.postgres_url(DATABASE), autocommit=True)
    cells = [(path, cond) for cond in SLOWED for path in PATHS]
    slow_file = BENCH_DIR / "reads-slow-retrieval"
    slow_file.write_text("0")
    # every ticket comment waits for an approval: a measured report stops at its proposal
    seeded = tenant_seed("reads", devices=len(cells) * n, kb="whole", rules={
        "ticket.create": {"requires_approval": False, "ttl_minutes": 600},
        "ticket.comment": {"requires_approval": True, "ttl_minutes": 600}})
    ports = {"proxy": free_port(), "web5": free_port()}
    proxy = f"http://127.0.0.1:{ports['proxy']}"
    env = {**bench.env, "REFSERVICE_URL": proxy, SLOW_RETRIEVAL_FILE: str(slow_file)}
    webs = {"parallel": f"http://127.0.0.1:{bench.ports['web']}", "sequential": f"http://127.0.0.1:{ports['web5']}"}
    names = ("refservice", "faultproxy", "web", "web-r5", "worker", "beat")
    started = time.monotonic()
    bench.start_refservice()
    try:
        bench.start("faultproxy", [sys.executable, "-m", "tools.faultproxy", "--port", str(ports["proxy"]),
                                   "--upstream", bench.env["REFSERVICE_URL"], "--fault-prefix", "/none/"])
        _start_web(bench, "web", bench.ports["web"], {**env, "FAULTDESK_BENCH_REDUCER": PATHS["parallel"]},
                   "tools.bench.pinned_wsgi:application")
        _start_web(bench, "web-r5", ports["web5"], {**env, "FAULTDESK_BENCH_REDUCER": PATHS["sequential"]},
                   "tools.bench.pinned_wsgi:application")
        bench.start_beat(env=env)
        bench.start_worker(CONCURRENCY, env=env, app="tools.bench.reads_worker")
        for url in (f"{proxy}/healthz", f"{webs['parallel']}/healthz", f"{webs['sequential']}/healthz"):
            bench.wait_http(url, 90)

        def alive() -> bool:
            return all(bench.procs[name].poll() is None for name in names)

        user = seeded.users["requester"]
        # 1. every device gets its open ticket, half through each web (which also warms both)
        half = len(seeded.devices) // 2
        seeding = (submit_all(webs["parallel"], user, seeded.devices[:half], half, prefix="seed-6")
                   + submit_all(webs["sequential"], user, seeded.devices[half:], len(seeded.devices) - half,
                                prefix="seed-5"))
        if wait_terminal(conn, seeding, timeout=300, alive=alive) < len(seeding):
            raise SystemExit(f"reads: the seeding reports did not end in 300 s; see {LOG_DIR}")
        with conn.cursor() as cur:
            cur.execute("SELECT count(DISTINCT t.device_id) FROM tickets_ticketmirror m JOIN actions_action a "
                        "ON a.id = m.action_id JOIN tasks_task t ON t.id = a.task_id WHERE t.id = ANY(%s::uuid[])",
                        [seeding])
            with_ticket = cur.fetchone()[0]
        if with_ticket < len(seeded.devices):
            raise SystemExit(f"reads: only {with_ticket} of {len(seeded.devices)} devices have an open ticket "
                             "after the seeding")
        seeded_s = time.monotonic() - started
        # 2. the measured reports, one at a time, the cells of a round in a shuffled order
        sessions = {path: session_client(url, user) for path, url in webs.items()}
        devices = iter(seeded.devices)
        rng = random.Random(seed)  # noqa: S311 - an order of cells, not a secret
        ids: dict[tuple[str, str], list[str]] = {cell: [] for cell in cells}
        slowed = {}
        measure_started = time.monotonic()
        for r in range(n):
            order = cells[:]
            rng.shuffle(order)
            for path, cond in order:
                extra = {step: slow_seconds if SLOWED[cond] == step else 0.0 for step in ("ticket", "retrieval")}
                slowed = httpx.post(f"{proxy}/_proxy/slow-reads", json={"seconds": ticket_latency + extra["ticket"],
                                                                        "prefix": SLOW_PREFIX}).json()
                slow_file.write_text(repr(extra["retrieval"]))
                [task_id] = submit_all(webs[path], user, [next(devices)], 1, prefix=f"m-{path}-{cond}-{r}",
                                       clients=[sessions[path]])
                _wait_proposed(conn, task_id, timeout=60, alive=alive)
                ids[(path, cond)].append(task_id)
        measured_s = time.monotonic() - measure_started
        load = os.getloadavg()[0]
        slowed = httpx.get(f"{proxy}/_proxy/slow-reads").json()
        for client in sessions.values():
            client.close()
        bench.note_peak("worker", "worker")
    finally:
        for name in reversed(names):
            bench.stop(name)
    slow_file.write_text("0")
    _report(bench, conn, ids, n=n, slow_seconds=slow_seconds, ticket_latency=ticket_latency,
            delayed=slowed.get("delayed", 0),
            seeded_s=seeded_s, measured_s=measured_s, devices=len(seeded.devices), load=load)
    conn.close()


def _report(bench: Bench, conn, ids: dict, *, n: int, slow_seconds: float, ticket_latency: float, delayed: int,
            seeded_s: float, measured_s: float, devices: int, load: float) -> None:
    every = [i for cell in ids.values() for i in cell]
    events = _events(conn, every)
    with conn.cursor() as cur:
        cur.execute("SELECT t.id::text, t.artifact_bundle->>'reducer', t.lease_generation, "
                    "(SELECT count(*) FROM events_taskevent e WHERE e.task_id = t.id AND e.type = 'ticket.read' "
                    "AND e.payload->'ticket' <> 'null'::jsonb) FROM tasks_task t WHERE t.id = ANY(%s::uuid[])",
                    [every])
        rows = {r[0]: r[1:] for r in cur.fetchall()}
    with conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM evidence_chunk c JOIN tasks_task t ON t.tenant_id = c.tenant_id "
                    "WHERE t.id = %s", [every[0]])
        chunks = cur.fetchone()[0]
    bench.figure("reads.reports_per_cell", n, "reports",
                 f"worker node agent,tools,outbox with {CONCURRENCY} prefork processes; the whole knowledge base "
                 f"({chunks} chunks); every open-ticket read {ticket_latency * 1000:.0f} ms at the fault proxy "
                 f"({delayed} reads delayed), {slow_seconds:g} s more in the slow cells, retrieval {slow_seconds:g} s "
                 f"more in the slow_retrieval cells; {devices} devices seeded with an open ticket in "
                 f"{seeded_s:.0f} s; measured part {measured_s:.0f} s, load average {load:.2f} at its end")
    bench.figure("reads.slow_read_s", slow_seconds, "s", "what the slow read (the open-ticket read, or retrieval) "
                 "takes more in its cells")
    bench.figure("reads.ticket_latency_ms", ticket_latency * 1000, "ms", "the ticket system's base latency for "
                 "each open-ticket read (the fault proxy's delay), in every cell")
    results = {}
    for (path, cond), task_ids in ids.items():
        pinned = {rows[i][0] for i in task_ids}
        if pinned != {PATHS[path]}:
            raise SystemExit(f"reads: the {path} reports were pinned to {sorted(pinned)}, not {PATHS[path]}")
        if any(rows[i][2] != 1 for i in task_ids):
            raise SystemExit(f"reads: a {path} report read no open ticket: nothing was slow to read")
        totals, spans, waits = [], [], []
        for i in task_ids:
            s = proposal_spans([(etype, at) for etype, at, _ in events[i]])
            if path == "parallel":
                waits.append(report_waits(events[i]))
            if s is None:
                raise SystemExit(f"reads: task {i} has no proposal event after its reads")
            totals.append(s["total"])
            spans.append(s)
        res = cell_summary(totals)
        res["spans"] = {k: percentile([s[k] for s in spans], 50) for k in ("start", "reads", "after")}
        res["claims"] = percentile([rows[i][1] for i in task_ids], 50)
        res["events"] = percentile([len(events[i]) for i in task_ids], 50)
        results[(path, cond)] = res
        key = f"reads.{path}.{cond}"
        what = f"{PATHS[path]}, " + ("no slow read" if SLOWED[cond] is None
                                     else f"{SLOWED[cond]} read +{slow_seconds:g} s")
        bench.figure(f"{key}.p50_ms", res["p50"] * 1000, "ms", f"accepted → proposal, {what}, n={res['n']}")
        bench.figure(f"{key}.p95_ms", res["p95"] * 1000, "ms")
        sp = res["spans"]
        bench.figure(f"{key}.reads_p50_ms", sp["reads"] * 1000, "ms",
                     f"p50 of the spans: to the first worker event {sp['start'] * 1000:.0f} ms, reads "
                     f"{sp['reads'] * 1000:.0f} ms, after the last read {sp['after'] * 1000:.0f} ms; "
                     f"{res['claims']:.0f} lease claims, {res['events']:.0f} events per task")
        if waits and all(w is not None for w in waits):
            if all(w["local"] is not None for w in waits):
                bench.figure(f"{key}.local_reads_p50_ms", percentile([w["local"] for w in waits], 50) * 1000,
                             "ms", "the dispatch's last reservation → the local reads (device, retrieval) reported "
                                   "in the dispatching run")
            bench.figure(f"{key}.read_hop_p50_ms", percentile([w["hop"] for w in waits], 50) * 1000, "ms",
                         "the dispatch's last reservation → the open-ticket read finished (read_step's Celery hop, "
                         "the task row read, the read with the ticket system's latency)")
            bench.figure(f"{key}.report_wait_p50_ms", percentile([w["report"] for w in waits], 50) * 1000, "ms",
                         "the open-ticket read finished → its event recorded (the lease taken, while the "
                         "dispatching run may hold it, then the record)")
    for cond in SLOWED:
        seq, par = results[("sequential", cond)], results[("parallel", cond)]
        for q in ("p50", "p95"):
            bench.figure(f"reads.{cond}.ratio_{q}", par[q] / seq[q], "",
                         f"parallel ÷ sequential {q}: {par[q] * 1000:.0f} ÷ {seq[q] * 1000:.0f} ms, "
                         f"{(seq[q] - par[q]) * 1000:+.0f} ms cut")
