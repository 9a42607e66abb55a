"""``make chaos``: the chaos run of DESIGN.md §12 invariant 5.

N tasks per ticket system go through the whole main job — HTTP API, agent, tools and outbox
workers, beat, the reference ticket service and django-helpdesk — on an auto-approval policy,
while this process SIGKILLs random workers (the dispatcher among them) and beat and restarts
them, and arms random remote faults (a response dropped after the remote committed, 503s,
delays) on the reference service and on the fault proxy in front of helpdesk. Then it stops the
chaos, lets everything settle and checks, for each ticket system::

    reference: tasks=200 completed=… waiting=… failed=… lost=0 duplicate_effects=0 replay_divergences=0

* ``lost``: a task the API accepted that is missing, or that is still in a running state after
  the settle time with nothing left to wait for;
* ``duplicate_effects``: effects (tickets, and comments on an open ticket) beyond one per
  idempotency key, plus effects beyond one per task;
* ``replay_divergences``: tasks whose replay differs from their row, or whose action records
  disagree with their state or with the ticket system (``replay --all --remote``'s audit).

Exit status 1 when any of the three is not zero. Everything runs in its own database
(``faultdesk_chaos`` on the embedded PostgreSQL, recreated each run), its own Redis database and
its own ticket-system files under ``var/chaos/``; figures also go to ``var/chaos/result.json``.

Usage: ``python -m tools.chaos [--n 200] [--helpdesk-n 50] [--only reference|helpdesk]
[--seed S]``.
"""

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

from config import embedded
from config.env import BASE_DIR, VAR_DIR
from tools.helpdesk_site import run as helpdesk_site

CHAOS_DIR = VAR_DIR / "chaos"
DATABASE = "faultdesk_chaos"
REDIS_DB = 8
BIN = Path(sys.executable).parent
API_KEY = "chaos-refservice-key"
HD_TOKEN = "chaoshelpdesktoken".ljust(40, "0")
PASSWORD = "chaos-password"  # noqa: S105 - a throw-away database
SYMPTOMS = [
    "Fuser error after warm-up, pages come out smeared with unfused toner.",
    "Paper jams at the fuser exit on every duplex job from tray 2.",
    "Toner smears on every page and the fuser temperature alert keeps coming back.",
]
KILLABLE = ["worker-agent-1", "worker-agent-2", "worker-tools", "worker-outbox-1", "worker-outbox-2", "beat"]
RUNNING = ("ACCEPTED", "RETRIEVING", "PROPOSING", "VALIDATING", "DISPATCHING", "COMPENSATING")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Chaos:
    """The processes of one chaos run and the chaos applied to them."""

    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)  # noqa: S311 - chaos, not security
        self.ports = {name: _free_port() for name in ("web", "ref", "hd", "proxy")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.kills = 0
        self.faults = 0
        self.stop = threading.Event()
        self.hd_var = CHAOS_DIR / "helpdesk"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings.local",
            "DJANGO_DEBUG": "false",
            # one load-generating client per role: the API's per-user rate is for people, not this
            "FAULTDESK_API_RATE_USER": "1000000/minute",
            "DATABASE_URL": embedded.postgres_url(DATABASE),
            "REDIS_URL": embedded.redis_url(REDIS_DB),
            "REFSERVICE_URL": f"http://127.0.0.1:{self.ports['ref']}",
            "REFSERVICE_API_KEY": API_KEY,
            "REFSERVICE_WEBHOOK_SECRET": "chaos-webhook-secret",
            "REFSERVICE_WEBHOOK_URL": f"http://127.0.0.1:{self.ports['web']}/webhooks/reference/",
            "HELPDESK_URL": f"http://127.0.0.1:{self.ports['proxy']}",
            "HELPDESK_API_TOKEN": HD_TOKEN,
            # Faster recovery than production defaults, so a run fits in minutes.
            "FAULTDESK_LEASE_SECONDS": "15",
            "FAULTDESK_OUTBOX_LEASE_SECONDS": "8",
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
            "worker-tools": worker("tools", "tools"),
            "worker-outbox-1": worker("outbox", "outbox1"),
            "worker-outbox-2": worker("outbox", "outbox2"),
            "beat": [*celery, "beat", "-s", str(CHAOS_DIR / "beat-schedule"), "--loglevel", "INFO"],
        }

    def start_all(self) -> None:
        self.start("refservice", [sys.executable, "-m", "tools.refservice", "--port", str(self.ports["ref"]),
                                  "--db", str(CHAOS_DIR / "tickets.sqlite3"), "--api-key", API_KEY])
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
        self.wait_http(f"http://127.0.0.1:{self.ports['proxy']}/helpdesk/login/", 60)

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
            self.kill(name)
        for log in self.logs.values():
            log.close()

    # --- chaos ---------------------------------------------------------------------------------

    def chaos_loop(self) -> None:
        """Until ``stop``: every 1–3 s either SIGKILL a random worker or beat (restarted 0.5–2 s
        later), or arm a random fault on a ticket system for its next 1–3 writes."""
        commands = self.commands()
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)):
            if self.rng.random() < 0.5:
                victim = self.rng.choice(KILLABLE)
                self.kill(victim)
                self.kills += 1
                if self.stop.wait(self.rng.uniform(0.5, 2.0)):
                    self.start(victim, commands[victim])
                    return
                self.start(victim, commands[victim])
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


def _manage(env: dict, *args: str) -> str:
    out = subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], cwd=BASE_DIR, env=env,  # noqa: S603
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"manage.py {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def _fresh_database() -> None:
    import pgserver

    embedded.ensure_postgres()
    server = pgserver.get_server(embedded.PGDATA, cleanup_mode=None)
    server.psql(f'SET client_min_messages = warning; DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE);')
    server.psql(f'CREATE DATABASE "{DATABASE}";')


def _submit_all(chaos: Chaos, plan: list[tuple[str, int]]) -> dict[str, list[str]]:
    """Submit every planned task over the API (retrying with the same Idempotency-Key); returns
    the accepted task ids per ticket system."""
    base = f"http://127.0.0.1:{chaos.ports['web']}"
    devices = json.loads((CHAOS_DIR / "devices.json").read_text())
    accepted: dict[str, list[str]] = {system: [] for system, _ in plan}
    lock = threading.Lock()

    def submit(system: str, i: int) -> None:
        user = f"chaos-{system}"
        body = {"device_id": devices[system][i % len(devices[system])], "symptom": SYMPTOMS[i % len(SYMPTOMS)],
                "urgency": "high"}
        key = f"chaos-{system}-{i}"
        for attempt in range(20):
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

    jobs = [(system, i) for system, n in plan for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda job: submit(*job), jobs))
    return accepted


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
    print(f"• chaos run: {', '.join(f'{n} tasks on {s}' for s, n in plan)}, seed {args.seed}", flush=True)
    embedded.ensure_redis()
    _fresh_database()
    chaos = Chaos(args)
    print("• migrating and seeding the chaos database", flush=True)
    _manage(chaos.env, "migrate", "--no-input", "-v", "0")
    # About two reports per printer: most printers get a ticket and then a comment on it, some
    # comments race each other (a 412 and a re-plan), as when a few people report the same fault.
    per_system = {s: max(10, n // 2) for s, n in plan}
    _manage(chaos.env, "shell", "-c", f"from tools.chaos import seed; seed({json.dumps(per_system)})")
    helpdesk_site.prepare(chaos.hd_var, HD_TOKEN)
    import redis

    redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=REDIS_DB).flushdb()
    try:
        chaos.start_all()
        print("• processes up; chaos starts", flush=True)
        loop = threading.Thread(target=chaos.chaos_loop, daemon=True)
        loop.start()
        accepted = _submit_all(chaos, plan)
        (CHAOS_DIR / "accepted.json").write_text(json.dumps(accepted))
        print(f"• {sum(map(len, accepted.values()))} tasks accepted; chaos goes on for {args.chaos_seconds} s",
              flush=True)
        time.sleep(args.chaos_seconds)
        chaos.stop.set()
        loop.join(10)
        chaos.disarm()
        for name, cmd in chaos.commands().items():  # everything that was killed runs again
            if chaos.procs[name].poll() is not None:
                chaos.start(name, cmd)
        print(f"• chaos stopped ({chaos.kills} kills, {chaos.faults} remote faults); settling", flush=True)
        _settle(chaos, args.settle_seconds)
        out = _manage(chaos.env, "shell", "-c", "from tools.chaos import check; check()")
    finally:
        chaos.stop.set()
        chaos.stop_all()
    result = json.loads(out.strip().splitlines()[-1])
    status = 0
    for system, figures in result.items():
        print(f"{system}: " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
        if figures["lost"] or figures["duplicate_effects"] or figures["replay_divergences"]:
            status = 1
    elapsed = time.monotonic() - started
    print(f"chaos applied to both: {chaos.kills} SIGKILLs of workers and beat, {chaos.faults} remote faults armed",
          flush=True)
    (CHAOS_DIR / "result.json").write_text(json.dumps({"elapsed_seconds": round(elapsed), "kills": chaos.kills,
                                                       "remote_faults": chaos.faults, **result}, indent=2))
    print(f"chaos {'FAILED' if status else 'OK'} in {elapsed:.0f} s (details in {CHAOS_DIR})", flush=True)
    return status


def _settle(chaos: Chaos, timeout: float) -> None:
    """Wait until no task is in a running or reconciling state (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    moving = [*RUNNING, "WAITING_RECONCILIATION"]
    query = f"from apps.tasks.models import Task; print(Task.objects.filter(status__in={moving!r}).count())"
    while time.monotonic() < deadline:
        busy = int(_manage(chaos.env, "shell", "-c", query).strip().splitlines()[-1])
        if busy == 0:
            return
        print(f"  {busy} task{'s' if busy != 1 else ''} still moving", flush=True)
        time.sleep(5)


# --- run inside Django (manage.py shell -c) --------------------------------------------------------


def seed(printers: dict[str, int]) -> None:
    """Create one tenant per ticket system (``printers`` maps it to a number of printers) with a
    requester ``chaos-<system>``, an auto-approval policy for new tickets and comments, that many
    printers and the public printer procedures; write the device ids to ``var/chaos/devices.json``."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import make_password

    from apps.accounts.models import AccessScope, Membership, Role, Tenant
    from apps.approvals.models import ApprovalPolicy
    from apps.devices.models import Device
    from apps.evidence.corpus import KB_DIR
    from apps.evidence.services import document_ingest

    devices = {}
    for system, count in printers.items():
        tenant = Tenant.objects.create(slug=f"chaos-{system}", name=f"Chaos {system}", ticket_system=system)
        user = get_user_model().objects.create(username=f"chaos-{system}",
                                               password=make_password(PASSWORD, hasher="pbkdf2_sha256"))
        Membership.objects.create(user=user, tenant=tenant, role=Role.REQUESTER,
                                  scopes=[AccessScope.PUBLIC, AccessScope.TIER2])
        ApprovalPolicy.objects.create(tenant=tenant, version=1, rules={
            "ticket.create": {"requires_approval": False, "ttl_minutes": 60},
            "ticket.comment": {"requires_approval": False, "ttl_minutes": 60}})
        devices[system] = [
            Device.objects.create(tenant=tenant, asset_tag=f"PRN-9{i:03d}", name=f"Chaos printer {i}", kind="printer",
                                  model="LaserMax 9050", site="LAB", criticality="medium", state="fault",
                                  alert_code="PRN-FUSER-50.2", alert_message="Fuser temperature low: 142 C",
                                  version=1).pk
            for i in range(count)
        ]
        for scope, name in (("tier2", "laser-printer-fuser-error-replacement.md"),
                            ("public", "laser-printer-paper-jam.md"), ("public", "mfp-toner-and-drum-replacement.md")):
            document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB_DIR / scope / name).read_text(),
                            scope=scope)
    (CHAOS_DIR / "devices.json").write_text(json.dumps(devices))


def check() -> None:
    """Print one JSON line: per ticket system, the figures of the module docstring."""
    from apps.actions.audit import task_actions_audit
    from apps.actions.models import Action, ActionAttempt
    from apps.events.models import RefusedEvent, TaskEvent
    from apps.tasks.models import Task
    from apps.tasks.replay import task_replay
    from apps.tickets.connectors import CONNECTORS

    accepted = json.loads((CHAOS_DIR / "accepted.json").read_text())
    result = {}
    for system, ids in accepted.items():
        connector = CONNECTORS[system]()
        tasks = {str(t.pk): t for t in Task.objects.filter(pk__in=ids)}
        statuses = [t.status for t in tasks.values()]
        lost = (len(ids) - len(tasks)) + sum(s in RUNNING for s in statuses)
        remote = _remote_effects(system, connector)
        by_key: dict[str, int] = {}
        for key in remote:
            by_key[key] = by_key.get(key, 0) + 1
        duplicates = sum(n - 1 for n in by_key.values() if n > 1)
        for task_id in tasks:
            keys = set(Action.objects.filter(task_id=task_id).values_list("idempotency_key", flat=True))
            per_task = sum(by_key.get(k, 0) for k in keys)
            duplicates += max(0, per_task - 1)
        divergences = 0
        for task in tasks.values():
            if not task_replay(task).ok or task_actions_audit(task, remote=True):
                divergences += 1
        attempts = ActionAttempt.objects.filter(action__task_id__in=ids)
        result[system] = {
            "tasks": len(ids), "completed": statuses.count("COMPLETED"),
            "waiting": sum(s.startswith("WAITING") for s in statuses), "failed": statuses.count("FAILED"),
            "cancelled": statuses.count("CANCELLED"), "lost": lost, "duplicate_effects": duplicates,
            "replay_divergences": divergences, "remote_effects": len(remote),
            "comments": TaskEvent.objects.filter(task_id__in=ids, type="task.completed",
                                                 payload__reason="ticket_commented").count(),
            "conflicts": TaskEvent.objects.filter(task_id__in=ids, type="dispatch.conflict").count(),
            # What the chaos did to the work: sends without an answer, refused or retried sends,
            # receipts found by the reconciler, and events refused to a stale worker.
            "unknown_outcomes": attempts.filter(outcome="UNKNOWN").count(),
            "retried_sends": attempts.filter(outcome="RETRYABLE").count(),
            "reconciled_receipts": TaskEvent.objects.filter(task_id__in=ids, type="receipt.recorded",
                                                            actor="reconciler").count(),
            "refused_events": RefusedEvent.objects.filter(task_id__in=ids).count(),
        }
    print(json.dumps(result))


def _remote_effects(system: str, connector) -> list[str]:
    """The idempotency key of every effect the ticket system holds: one entry per ticket and, at
    the reference service, one per comment (a second report on an open ticket is a comment)."""
    if system == "reference":
        resp = httpx.get(f"{connector.base_url}/_admin/tickets",
                         headers={"Authorization": f"Bearer {connector.api_key}"}, timeout=30)
        tickets = resp.json()["results"]
        return [t["idempotency_key"] for t in tickets] + [
            c["idempotency_key"] for t in tickets for c in t.get("comments", []) if c.get("idempotency_key")]
    keys, url = [], f"{connector.base_url}/helpdesk/api/tickets/"
    while url:
        page = httpx.get(url, headers={"Authorization": f"Token {connector.token}"}, timeout=60).json()
        keys += [t.get("custom_faultdesk_key") or "" for t in page["results"]]
        url = page.get("next")
    return keys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="tasks against the reference service (default 200)")
    parser.add_argument("--helpdesk-n", type=int, default=50, help="tasks against django-helpdesk (default 50)")
    parser.add_argument("--only", choices=["reference", "helpdesk"], default=None)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--chaos-seconds", type=int, default=60, help="chaos after the last submission (60)")
    parser.add_argument("--settle-seconds", type=int, default=600, help="longest wait for tasks to settle (600)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
