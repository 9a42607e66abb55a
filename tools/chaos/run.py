"""The chaos run's processes, its faults over time and its verdict (``python -m tools.chaos``; the
package docstring says what it checks)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from config.env import BASE_DIR
from tools.chaos import API_KEY, CHAOS_DIR, CHAOS_PGDATA, DATABASE, HD_TOKEN, PASSWORD, REDIS_DB, RUNNING
from tools.chaos import faults as long_faults
from tools.helpdesk_site import run as helpdesk_site

BIN = Path(sys.executable).parent
SYMPTOMS = [
    "Fuser error after warm-up, pages come out smeared with unfused toner.",
    "Paper jams at the fuser exit on every duplex job from tray 2.",
    "Toner smears on every page and the fuser temperature alert keeps coming back.",
]
KILLABLE = ["worker-agent-1", "worker-agent-2", "worker-tools-1", "worker-tools-2", "worker-outbox-1",
            "worker-outbox-2", "beat"]
#: the leases of the chaos run (seconds): short, so that a run fits in minutes
LEASE_SECONDS = 15
OUTBOX_LEASE_SECONDS = 8
#: the long faults every run takes at least once each, in a shuffled order
LONG_FAULTS = [("pause", "worker-agent-1"), ("pause", "worker-tools-1"), ("pause", "worker-outbox-1"),
               ("partition", "reference"), ("partition", "helpdesk"), ("postgres_restart", "postgresql")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chaos_postgres() -> str:
    """Start (or reuse) the chaos run's own PostgreSQL in ``var/chaos-pgdata`` — the run restarts it,
    so it is not the embedded server others use — recreate the database with pgvector, and return
    its URL."""
    import pgserver
    from pgserver.utils import PostmasterInfo

    CHAOS_PGDATA.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(CHAOS_PGDATA, cleanup_mode=None)
    server.psql(f'SET client_min_messages = warning; DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE);')
    server.psql("SET client_min_messages = warning; CREATE EXTENSION IF NOT EXISTS vector;")
    server.psql(f'CREATE DATABASE "{DATABASE}";')
    info = PostmasterInfo.read_from_pgdata(CHAOS_PGDATA)
    url = f"postgres://postgres:@/{DATABASE}?host={info.socket_dir}&port={info.port or 5432}"
    long_faults.query(url, "CREATE EXTENSION IF NOT EXISTS vector")
    return url


def stop_chaos_postgres() -> None:
    """Stop the chaos run's PostgreSQL (its data stays in ``var/chaos-pgdata`` for a look)."""
    if (CHAOS_PGDATA / "postmaster.pid").exists():
        long_faults.pg_ctl(CHAOS_PGDATA, "-m", "fast", "-w", "stop")


class Chaos:
    """The processes of one chaos run and the chaos applied to them."""

    def __init__(self, args, database_url: str, broker_url: str, redis_url: str):
        self.args = args
        self.rng = random.Random(args.seed)  # noqa: S311 - chaos, not security
        self.ports = {name: _free_port() for name in ("web", "ref", "hd", "proxy", "refproxy")}
        self.database_url = database_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.kills = 0
        self.faults = 0
        self.long: list[long_faults.FaultRecord] = []
        self.paused: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.hd_var = CHAOS_DIR / "helpdesk"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings.local",
            "DJANGO_DEBUG": "false",
            # one load-generating client per role: the API's per-user rate is for people, not this
            "FAULTDESK_API_RATE_USER": "1000000/minute",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "CELERY_BROKER_URL": broker_url,
            # the reference service and django-helpdesk are each reached through a fault proxy
            "REFSERVICE_URL": f"http://127.0.0.1:{self.ports['refproxy']}",
            "REFSERVICE_API_KEY": API_KEY,
            "REFSERVICE_WEBHOOK_SECRET": "chaos-webhook-secret",
            "REFSERVICE_WEBHOOK_URL": f"http://127.0.0.1:{self.ports['web']}/webhooks/reference/",
            "HELPDESK_URL": f"http://127.0.0.1:{self.ports['proxy']}",
            "HELPDESK_API_TOKEN": HD_TOKEN,
            # Faster recovery than production defaults, so a run fits in minutes.
            "FAULTDESK_LEASE_SECONDS": str(LEASE_SECONDS),
            "FAULTDESK_OUTBOX_LEASE_SECONDS": str(OUTBOX_LEASE_SECONDS),
            "FAULTDESK_SWEEP_EVERY_SECONDS": "2",
            "FAULTDESK_SWEEPER_IDLE_SECONDS": "5",
            "FAULTDESK_RETRY_BACKOFF_BASE_SECONDS": "0.5",
            "HELPDESK_REQUEST_LIFETIME_SECONDS": "15",
            "REFSERVICE_TIMEOUT_SECONDS": "5",
            "PYTHONUNBUFFERED": "1",
        }

    # --- processes ---------------------------------------------------------------------------

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> None:
        log = self.logs.get(name) or open(CHAOS_DIR / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop_all
        self.logs[name] = log
        self.procs[name] = subprocess.Popen(cmd, cwd=BASE_DIR, env=env or self.env, stdout=log,  # noqa: S603
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def commands(self) -> dict[str, list[str]]:
        celery = [str(BIN / "celery"), "-A", "config"]

        def worker(queues: str, name: str) -> list[str]:
            return [*celery, "worker", "-Q", queues, "-n", f"{name}-chaos@%h", "-c", "2", "--loglevel", "INFO"]

        return {
            "worker-agent-1": worker("agent", "agent1"),
            "worker-agent-2": worker("agent", "agent2"),
            "worker-tools-1": worker("tools", "tools1"),
            "worker-tools-2": worker("tools", "tools2"),
            "worker-outbox-1": worker("outbox", "outbox1"),
            "worker-outbox-2": worker("outbox", "outbox2"),
            "beat": [*celery, "beat", "-s", str(CHAOS_DIR / "beat-schedule"), "--loglevel", "INFO"],
        }

    def proxy_url(self, system: str) -> str:
        return f"http://127.0.0.1:{self.ports['refproxy' if system == 'reference' else 'proxy']}"

    def start_all(self) -> None:
        self.start("refservice", [sys.executable, "-m", "tools.refservice", "--port", str(self.ports["ref"]),
                                  "--db", str(CHAOS_DIR / "tickets.sqlite3"), "--api-key", API_KEY])
        self.start("refproxy", [sys.executable, "-m", "tools.faultproxy", "--port", str(self.ports["refproxy"]),
                                "--upstream", f"http://127.0.0.1:{self.ports['ref']}", "--fault-prefix", "/none/"])
        # gunicorn kills a helpdesk request after 10 s here; HELPDESK_REQUEST_LIFETIME_SECONDS is 15.
        hd_env = helpdesk_site.helpdesk_env(self.hd_var)
        self.start("helpdesk", helpdesk_site.gunicorn_command(self.ports["hd"], timeout=10), env=hd_env)
        self.start("faultproxy", [sys.executable, "-m", "tools.faultproxy", "--port", str(self.ports["proxy"]),
                                  "--upstream", f"http://127.0.0.1:{self.ports['hd']}",
                                  "--fault-prefix", "/helpdesk/api/tickets/"])
        self.start("web", [str(BIN / "gunicorn"), "config.wsgi", "-b", f"127.0.0.1:{self.ports['web']}", "-w", "2",
                           "--threads", "4", "--timeout", "60"])
        for name, cmd in self.commands().items():
            self.start(name, cmd)
        self.wait_http(f"http://127.0.0.1:{self.ports['web']}/healthz", 90)
        self.wait_http(f"http://127.0.0.1:{self.ports['ref']}/healthz", 30)
        self.wait_http(f"{self.proxy_url('reference')}/healthz", 30)
        self.wait_http(f"{self.proxy_url('helpdesk')}/helpdesk/login/", 60)

    def wait_http(self, url: str, timeout: float) -> None:
        from tools.devstack import wait_http

        if not wait_http(url, timeout):
            raise SystemExit(f"{url} did not answer within {timeout:.0f} s; see {CHAOS_DIR}/*.log")

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            try:
                os.killpg(self.procs[name].pid, signal.SIGCONT)  # a paused process dies as well
            except ProcessLookupError:
                pass
            self.kill(name)
        for log in self.logs.values():
            log.close()

    # --- the small faults: kills and remote faults, every 1–3 s -------------------------------------

    def chaos_loop(self) -> None:
        """Until ``stop``: every 1–3 s either SIGKILL a random worker or beat that is not paused
        (restarted 0.5–2 s later), or arm a random fault on a ticket system for its next 1–3 writes."""
        commands = self.commands()
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)):
            if self.rng.random() < 0.5:
                with self.lock:
                    candidates = [name for name in KILLABLE if name not in self.paused]
                    victim = self.rng.choice(candidates)
                    self.paused.add(victim)  # not paused by the long faults while it is dead
                self.kill(victim)
                self.kills += 1
                self.stop.wait(self.rng.uniform(0.5, 2.0))
                self.start(victim, commands[victim])
                with self.lock:
                    self.paused.discard(victim)
            else:
                mode = self.rng.choice(["drop_after_commit", "fail_503", "delay"])
                body = {"mode": mode, "count": self.rng.randint(1, 3),
                        "delay_seconds": round(self.rng.uniform(0.5, 3), 2)}
                target = self.rng.choice(["ref", "proxy"])
                url = (f"http://127.0.0.1:{self.ports['ref']}/_admin/faults" if target == "ref"
                       else f"http://127.0.0.1:{self.ports['proxy']}/_proxy/faults")
                try:
                    httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
                    self.faults += 1
                except httpx.HTTPError:
                    pass

    def disarm(self) -> None:
        for url in (f"http://127.0.0.1:{self.ports['ref']}/_admin/faults",
                    f"http://127.0.0.1:{self.ports['proxy']}/_proxy/faults"):
            httpx.post(url, json={"mode": "none"}, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
        for system in ("reference", "helpdesk"):
            httpx.post(f"{self.proxy_url(system)}/_proxy/partition", json={"seconds": 0}, timeout=5)

    # --- the long faults: one at a time, each target at least once -----------------------------------

    def long_fault_plan(self, systems: list[str]) -> list[tuple[str, str]]:
        plan = [f for f in LONG_FAULTS if f[0] != "partition" or f[1] in systems]
        self.rng.shuffle(plan)
        return plan

    def long_fault_loop(self, plan: list[tuple[str, str]], done: threading.Event) -> None:
        """Take the faults of ``plan`` one after another, 5–10 s apart; then more, drawn from the same
        kinds, until ``stop``. A planned fault that did not take effect (skipped while its target was
        being restarted, refused, its process gone) goes to the back of the plan and is tried again.
        ``done`` is set once every fault of the plan has taken effect."""
        queue = list(plan)
        taken: set[tuple[str, str]] = set()
        while not self.stop.wait(self.rng.uniform(5.0, 10.0)):
            if not queue:
                done.set()
                queue = [self.rng.choice(plan)]
            kind, target = queue.pop(0)
            try:
                record = self.take(kind, target)
            except Exception as exc:  # noqa: BLE001 - report it, keep the run going
                print(f"  long fault {kind} {target} could not be taken: {exc!r}", flush=True)
                record = None
            if record is not None and not (self.stop.is_set() and record.seconds < 1.0):
                self.long.append(record)
                print(f"  fault {len(self.long)}: {record.line()}", flush=True)
            if record is not None and record.taken:
                taken.add((kind, target))
            elif (kind, target) not in taken and (kind, target) not in queue:
                queue.append((kind, target))  # not taken yet: again after the rest of the plan
        if not queue:
            done.set()

    def take(self, kind: str, target: str) -> long_faults.FaultRecord | None:
        web = f"http://127.0.0.1:{self.ports['web']}"
        if kind == "pause":
            with self.lock:
                if target in self.paused:
                    return None  # being killed and restarted right now
                self.paused.add(target)
            lease = OUTBOX_LEASE_SECONDS if target.startswith("worker-outbox") else LEASE_SECONDS
            try:
                return long_faults.pause(self.procs[target], target, lease + self.rng.uniform(5.0, 12.0), lease,
                                         self.database_url, self.stop)
            finally:
                with self.lock:
                    self.paused.discard(target)
        if kind == "partition":
            return long_faults.partition(self.proxy_url(target), target, self.rng.uniform(12.0, 25.0),
                                         self.database_url, f"chaos-{target}")
        return long_faults.postgres_restart(CHAOS_PGDATA, CHAOS_PGDATA / "restart.log", self.rng.uniform(2.0, 8.0),
                                            self.database_url, web)


def long_fault_problems(records: list[long_faults.FaultRecord], plan: list[tuple[str, str]]) -> list[str]:
    """Why the long faults fail the run: a fault that did not take effect or was not recovered from
    within its limit, and a fault of ``plan`` (kind, target) never taken — each target counts, not
    only each kind (a pause of the dispatcher is not a pause of an agent worker)."""
    problems = [f"{r.kind} {r.target}: {r.failure}" for r in records if r.failure]
    taken = {(r.kind, r.target) for r in records if r.taken}
    problems += [f"{kind} {target} was never taken" for kind, target in plan if (kind, target) not in taken]
    return problems


def _manage(env: dict, *args: str) -> str:
    out = subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], cwd=BASE_DIR, env=env,  # noqa: S603
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def _submit_all(chaos: Chaos, plan: list[tuple[str, int]]) -> dict[str, list[str]]:
    """Submit every planned task over the API (retrying with the same Idempotency-Key, through a
    PostgreSQL restart too); returns the accepted task ids per ticket system."""
    base = f"http://127.0.0.1:{chaos.ports['web']}"
    devices = json.loads((CHAOS_DIR / "devices.json").read_text())
    accepted: dict[str, list[str]] = {system: [] for system, _ in plan}
    lock = threading.Lock()

    def submit(system: str, i: int) -> None:
        user = f"chaos-{system}"
        body = {"device_id": devices[system][i % len(devices[system])], "symptom": SYMPTOMS[i % len(SYMPTOMS)],
                "urgency": "high"}
        key = f"chaos-{system}-{i}"
        for attempt in range(30):
            try:
                resp = httpx.post(f"{base}/api/tasks/", json=body, auth=(user, PASSWORD), timeout=30,
                                  headers={"Idempotency-Key": key})
                if resp.status_code in (200, 201):
                    with lock:
                        accepted[system].append(resp.json()["id"])
                    return
            except httpx.HTTPError:
                pass
            time.sleep(min(5.0, 0.2 * 2**attempt))
        raise SystemExit(f"task {key} was never accepted")

    # both systems' reports arrive all along (each in its own order), so every fault meets work in flight
    jobs = [(system, i) for system, n in plan for i in range(n)]
    jobs.sort(key=lambda job: job[1] / dict(plan)[job[0]])
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda job: submit(*job), jobs))
    return accepted


def _broker(kind: str) -> tuple[str, str]:
    """``(broker URL, Redis URL)`` of the run: Redis database 8 of the embedded Redis (this checkout's
    own), or a RabbitMQ virtual host named after this process (Redis then keeps only the coordination
    hints)."""
    from config import embedded
    from tools import rabbitmq

    embedded.ensure_redis()
    redis_url = embedded.redis_url(REDIS_DB)
    import redis

    redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=REDIS_DB).flushdb()
    if kind == "amqp":
        # a name of this run's own: another chaos run on the same RabbitMQ (another checkout) makes and
        # drops its own virtual host, never this one
        return rabbitmq.fresh_vhost(f"faultdesk_chaos_{os.getpid()}"), redis_url
    return redis_url, redis_url


def run(args) -> int:
    """The whole chaos run; returns the exit status."""
    started = time.monotonic()
    plan = []
    if args.only in (None, "reference"):
        plan.append(("reference", args.n))
    if args.only in (None, "helpdesk"):
        plan.append(("helpdesk", args.helpdesk_n))
    shutil.rmtree(CHAOS_DIR, ignore_errors=True)
    CHAOS_DIR.mkdir(parents=True)
    print(f"• chaos run: {', '.join(f'{n} tasks on {s}' for s, n in plan)}, broker {args.broker}, seed {args.seed}",
          flush=True)
    try:
        broker_url, redis_url = _broker(args.broker)
    except RuntimeError as exc:  # no RabbitMQ answering: say so, start nothing
        raise SystemExit(f"chaos: {exc}") from None
    database_url = chaos_postgres()
    chaos = Chaos(args, database_url, broker_url, redis_url)
    print("• migrating and seeding the chaos database (its own PostgreSQL in var/chaos-pgdata)", flush=True)
    _manage(chaos.env, "migrate", "--no-input", "-v", "0")
    # About two reports per printer: most printers get a ticket and then a comment on it, some
    # comments race each other (a 412 and a re-plan), as when a few people report the same fault.
    per_system = {s: max(10, n // 2) for s, n in plan}
    _manage(chaos.env, "shell", "-c", f"from tools.chaos import seed; seed({json.dumps(per_system)})")
    helpdesk_site.prepare(chaos.hd_var, HD_TOKEN)
    out = ""
    try:
        chaos.start_all()
        print("• processes up; chaos starts", flush=True)
        loop = threading.Thread(target=chaos.chaos_loop, daemon=True)
        loop.start()
        covered = threading.Event()
        long_plan = chaos.long_fault_plan([s for s, _ in plan])
        print(f"• long faults, one at a time: {', '.join(f'{k} {t}' for k, t in long_plan)}, then more", flush=True)
        long_loop = threading.Thread(target=chaos.long_fault_loop, args=(long_plan, covered), daemon=True)
        long_loop.start()
        accepted = _submit_all(chaos, plan)
        (CHAOS_DIR / "accepted.json").write_text(json.dumps(accepted))
        print(f"• {sum(map(len, accepted.values()))} tasks accepted; chaos goes on for {args.chaos_seconds} s "
              "and until every long fault has been taken", flush=True)
        time.sleep(args.chaos_seconds)
        covered.wait(args.settle_seconds)
        chaos.stop.set()
        loop.join(30)
        long_loop.join(300)
        chaos.disarm()
        for name, cmd in chaos.commands().items():  # everything that was killed runs again
            if chaos.procs[name].poll() is not None:
                chaos.start(name, cmd)
        print(f"• chaos stopped ({chaos.kills} kills, {chaos.faults} remote faults, {len(chaos.long)} long faults);"
              " settling", flush=True)
        _settle(chaos, args.settle_seconds)
        out = _manage(chaos.env, "shell", "-c", "from tools.chaos import check; check()")
    finally:
        chaos.stop.set()
        chaos.stop_all()
        stop_chaos_postgres()
        if args.broker == "amqp":
            from tools import rabbitmq

            rabbitmq.drop_vhost(broker_url)
    result = json.loads(out.strip().splitlines()[-1])
    status = 0
    for system, figures in result.items():
        print(f"{system}: " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
        if figures["lost"] or figures["duplicate_effects"] or figures["replay_divergences"] or figures["unreconciled"]:
            status = 1
    elapsed = time.monotonic() - started
    print(f"chaos applied to both: {chaos.kills} SIGKILLs of workers and beat, {chaos.faults} remote faults armed, "
          f"{len(chaos.long)} long faults", flush=True)
    print("recovery after each long fault:", flush=True)
    for n, record in enumerate(chaos.long, 1):
        print(f"  {n}. {record.line()}", flush=True)
    for problem in long_fault_problems(chaos.long, long_plan):
        print(f"long fault failed: {problem}", flush=True)
        status = 1
    (CHAOS_DIR / "result.json").write_text(json.dumps({
        "elapsed_seconds": round(elapsed), "broker": args.broker, "kills": chaos.kills,
        "remote_faults": chaos.faults, "long_faults": [r.as_dict() for r in chaos.long], **result}, indent=2))
    print(f"chaos {'FAILED' if status else 'OK'} in {elapsed:.0f} s (details in {CHAOS_DIR})", flush=True)
    return status


def _settle(chaos: Chaos, timeout: float) -> None:
    """Wait until no task is in a running or reconciling state (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    moving = [*RUNNING, "WAITING_RECONCILIATION"]
    while time.monotonic() < deadline:
        busy = long_faults.query(chaos.database_url, "SELECT count(*) FROM tasks_task WHERE status = ANY(%s)",
                                  (moving,))[0][0]
        if busy == 0:
            return
        print(f"  {busy} task{'s' if busy != 1 else ''} still moving", flush=True)
        time.sleep(5)


def main(argv=None) -> int:
    """Parse the command line and run; returns the exit status."""
    from tools import chaos as package

    parser = argparse.ArgumentParser(prog="python -m tools.chaos", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="tasks against the reference service (default 1000)")
    parser.add_argument("--helpdesk-n", type=int, default=100, help="tasks against django-helpdesk (default 100)")
    parser.add_argument("--only", choices=["reference", "helpdesk"], default=None)
    parser.add_argument("--broker", choices=["redis", "amqp"], default="redis",
                        help="the Celery broker: the embedded Redis, or the local RabbitMQ (FAULTDESK_RABBITMQ_URL)")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--chaos-seconds", type=int, default=60, help="chaos after the last submission (60)")
    parser.add_argument("--settle-seconds", type=int, default=900, help="longest wait for tasks to settle (900)")
    args = parser.parse_args(argv)
    if args.n < 0 or args.helpdesk_n < 0:
        parser.error("--n and --helpdesk-n must not be negative")
    return run(args)
