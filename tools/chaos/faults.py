"""The chaos run's long faults and how long the stack takes to recover from each.

Three kinds, one at a time, in a shuffled order that covers every target at least once:

* ``pause``: SIGSTOP of a worker node (a Celery worker and its pool processes: an agent worker, the
  tools worker, or an outbox worker — the dispatcher) for longer than its lease, then SIGCONT. Its
  leases run out while it sleeps; the sweeper hands its tasks and rows on; when it wakes, whatever it
  commits with its old fencing token is refused.
* ``partition``: the fault proxy in front of a ticket system swallows every request and every answer
  for a while (``tools/faultproxy.py``): sends time out with their outcome unknown, the reconciler
  cannot reach the system either, and after the partition heals the reconciler asks by key.
* ``postgres_restart``: the chaos run's own PostgreSQL is stopped (fast shutdown: every session is
  ended and its transaction rolled back), stays down a few seconds and is started again.

Recovery is read from the database the run uses (psycopg, a short connection per look):

* a pause: seconds from the SIGSTOP until every task and outbox row the paused node held a lease on
  has moved on (the task took an event, the row changed status or fencing token) — the takeover;
* a partition: seconds from the heal until the ticket system's tenant records its next receipt;
* a PostgreSQL restart: seconds from the server accepting connections again until the next event is
  recorded (and until web's ``/healthz`` answers 200).

``None`` when nothing was held or waiting (nothing to recover), or when the limit passed first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg

from tools.procfs import processes

#: task statuses that still move (as in tools.chaos.RUNNING)
MOVING = ("ACCEPTED", "RETRIEVING", "PROPOSING", "VALIDATING", "DISPATCHING", "COMPENSATING")


@dataclass
class FaultRecord:
    """One long fault: ``kind``, ``target``, when it began and ended (``time.time()``), its length in
    seconds, what it touched (``held``: leases a paused node held, ``swallowed``: requests a partition
    ate), and ``recovery_seconds`` (None: nothing to recover, or not within the limit: ``note`` says).
    ``taken`` is False when the fault never took effect (its process was gone, PostgreSQL did not stop);
    ``failure`` says what went wrong when it did not take effect or the stack did not recover from it
    within the limit — either fails the chaos run."""

    kind: str
    target: str
    started: float
    ended: float = 0.0
    held: int = 0
    swallowed: int = 0
    recovery_seconds: float | None = None
    healthz_seconds: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    taken: bool = True
    failure: str = ""

    def fail(self, why: str, *, taken: bool = True) -> None:
        """Record that the fault did not take effect (``taken=False``) or was not recovered from."""
        self.failure = self.note = why
        self.taken = self.taken and taken
        self.recovery_seconds = None

    @property
    def seconds(self) -> float:
        return max(0.0, self.ended - self.started)

    def line(self) -> str:
        """One printed line: what was done and how long recovery took."""
        if self.kind == "pause":
            what = f"pause {self.target} for {self.seconds:.1f} s ({self.extra.get('lease', '?')} s lease)"
            got = (f"{self.held} lease{'s' if self.held != 1 else ''} it held moved on "
                   f"{self.recovery_seconds:.1f} s after the SIGSTOP" if self.recovery_seconds is not None
                   else self.note)
            if "finished_meanwhile" in self.extra:
                got += f"; the others finished {self.extra['finished_meanwhile']} tasks meanwhile"
        elif self.kind == "partition":
            what = f"partition {self.target} for {self.seconds:.1f} s ({self.swallowed} requests swallowed)"
            got = (f"its next receipt {self.recovery_seconds:.1f} s after the heal"
                   if self.recovery_seconds is not None else self.note)
        else:
            what = f"PostgreSQL down {self.seconds:.1f} s ({self.held} tasks moving)"
            got = (f"next event {self.recovery_seconds:.1f} s after it was back, /healthz 200 after "
                   f"{self.healthz_seconds:.1f} s" if self.recovery_seconds is not None and self.healthz_seconds
                   is not None else self.note)
        return f"{what}: {got}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "seconds": round(self.seconds, 2), "held": self.held,
                "swallowed": self.swallowed, "recovery_seconds": _round(self.recovery_seconds),
                "healthz_seconds": _round(self.healthz_seconds), "note": self.note, "taken": self.taken,
                "failure": self.failure, **self.extra}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# --- the database, read directly (the chaos process is not a Django process) ----------------------


def query(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of ``sql`` on a fresh connection to ``url``; raises psycopg's error when the server is
    not there."""
    with psycopg.connect(url.replace("postgres://", "postgresql://", 1), connect_timeout=3, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description is not None else []


def process_group_pids(pgid: int) -> list[int]:
    """Every live process in the process group ``pgid`` (a worker node: its main process and pool)."""
    return [pid for pid, _, group in processes() if group == pgid]


def held_leases(url: str, owners: list[str]) -> dict[str, tuple]:
    """What the lease owners ``owners`` (``host:pid``) hold now: ``{"task:<id>": (lease_generation, status),
    "outbox:<id>": (lease_generation, status)}`` for leases not yet expired."""
    held: dict[str, tuple] = {}
    for pk, generation, status in query(
            url, "SELECT id, lease_generation, status FROM tasks_task WHERE lease_owner = ANY(%s) "
                 "AND lease_expires_at > now() AND status = ANY(%s)", (owners, list(MOVING))):
        held[f"task:{pk}"] = (generation, status)
    for pk, generation, status in query(
            url, "SELECT id, lease_generation, status FROM outbox_outboxmessage WHERE lease_owner = ANY(%s) "
                 "AND status = 'IN_FLIGHT'", (owners,)):
        held[f"outbox:{pk}"] = (generation, status)
    return held


def still_held(url: str, held: dict[str, tuple]) -> set[str]:
    """The keys of ``held`` (as :func:`held_leases` returns) whose row has not moved on since: same
    fencing token and status. A task's version alone is not enough: the paused node's own last commit,
    sent before the SIGSTOP, can still land after the look, and it takes nothing over."""
    tasks = [k.split(":", 1)[1] for k in held if k.startswith("task:")]
    rows = [k.split(":", 1)[1] for k in held if k.startswith("outbox:")]
    now: dict[str, tuple] = {}
    if tasks:
        for pk, generation, status in query(url, "SELECT id, lease_generation, status FROM tasks_task "
                                                 "WHERE id::text = ANY(%s)",
                                          (tasks,)):
            now[f"task:{pk}"] = (generation, status)
    if rows:
        for pk, generation, status in query(
                url, "SELECT id, lease_generation, status FROM outbox_outboxmessage WHERE id::text = ANY(%s)",
                (rows,)):
            now[f"outbox:{pk}"] = (generation, status)
    return {k for k, before in held.items() if now.get(k) == before}


def _finished(url: str) -> int | None:
    """How many tasks have finished (``task.completed`` recorded) so far; None when PostgreSQL does
    not answer."""
    try:
        return query(url, "SELECT count(*) FROM events_taskevent WHERE type = 'task.completed'")[0][0]
    except psycopg.OperationalError:
        return None


def wait_until(predicate, limit: float, step: float = 0.5) -> float | None:
    """Seconds until ``predicate()`` is true, or None after ``limit`` seconds. A server that does
    not answer (PostgreSQL restarting, web not up) counts as false; any other error is raised."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            if predicate():
                return time.monotonic() - started
        except (psycopg.OperationalError, httpx.HTTPError):
            pass
        time.sleep(step)
    return None


# --- the faults ---------------------------------------------------------------------------------


def pause(proc: subprocess.Popen, name: str, seconds: float, lease: float, url: str, stop_event,
          limit: float = 120.0, tries: int = 40) -> FaultRecord | None:
    """SIGSTOP the process group of ``proc`` for ``seconds`` (or until ``stop_event`` is set), then
    SIGCONT it; measure the takeover of what it held. It is paused at a moment it holds a lease when
    one comes within ``tries`` half-second looks (``extra["looks"]``). Returns the record (``recovery_seconds``
    counted from the SIGSTOP), None when ``stop_event`` was already set."""
    if stop_event.is_set():
        return None
    host = os.uname().nodename
    # Pause it while it holds a lease when it can: stop it, look, and if it holds nothing let it go on
    # for half a second and try again, for up to ``tries`` looks; then the pause goes on regardless.
    for attempt in range(tries):
        record = FaultRecord("pause", name, time.time(), extra={"lease": lease, "looks": attempt + 1})
        try:
            os.killpg(proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            record.ended = time.time()
            record.taken, record.note = False, "the process was gone"
            return record
        try:
            held = held_leases(url, [f"{host}:{pid}" for pid in process_group_pids(proc.pid)])
        except psycopg.OperationalError as exc:  # the database being restarted at that moment
            held, record.note = {}, f"could not read its leases: {exc!r}"
        if held or attempt == tries - 1 or stop_event.is_set():
            break
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.5)
    record.held = len(held)
    finished_before = _finished(url)
    stopped = time.monotonic()
    moved = None
    while time.monotonic() - stopped < seconds and not stop_event.is_set():
        if held and moved is None:
            try:
                if not still_held(url, held):
                    moved = time.monotonic() - stopped
            except psycopg.OperationalError:
                pass  # PostgreSQL not answering: look again
        time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    record.ended = time.time()
    finished_after = _finished(url)
    if finished_before is not None and finished_after is not None:
        record.extra["finished_meanwhile"] = finished_after - finished_before
    if not held:
        record.note = record.note or f"it held no lease at any of {record.extra['looks']} looks"
    elif moved is None:
        after = wait_until(lambda: not still_held(url, held), limit)
        if after is None:
            record.fail(f"what it held had not moved on {limit:.0f} s after the SIGCONT")
            return record
        moved = (record.ended - record.started) + after
    record.recovery_seconds = moved
    return record


def partition(proxy_url: str, name: str, seconds: float, url: str, tenant_slug: str, limit: float = 180.0
              ) -> FaultRecord:
    """Partition the ticket system behind ``proxy_url`` for ``seconds``; measure the time from the
    heal to the tenant's next ``receipt.recorded``."""
    record = FaultRecord("partition", name, time.time())
    before = httpx.get(f"{proxy_url}/_proxy/partition", timeout=5).json()["swallowed"]
    httpx.post(f"{proxy_url}/_proxy/partition", json={"seconds": seconds}, timeout=5).raise_for_status()
    time.sleep(seconds)
    deadline = time.monotonic() + 10
    while httpx.get(f"{proxy_url}/_proxy/partition", timeout=5).json()["partitioned"]:
        if time.monotonic() > deadline:
            httpx.post(f"{proxy_url}/_proxy/partition", json={"seconds": 0}, timeout=5)
        time.sleep(0.1)
    record.ended = time.time()
    state = httpx.get(f"{proxy_url}/_proxy/partition", timeout=5).json()
    record.swallowed = state["swallowed"] - before
    healed = record.ended
    waiting = query(url, "SELECT count(*) FROM tasks_task t JOIN accounts_tenant n ON n.id = t.tenant_id "
                          "WHERE n.slug = %s AND t.status <> ALL(%s)",
                     (tenant_slug, ["COMPLETED", "FAILED", "CANCELLED", "WAITING_APPROVAL"]))[0][0]
    if not waiting:
        record.note = "no task of its tenant was waiting to send"
        return record
    if not record.swallowed:  # the next receipt would measure nothing the partition did
        record.note = "it swallowed no request: nothing of the tenant's met it"
        return record

    def receipt_after() -> bool:
        return bool(query(url, "SELECT 1 FROM events_taskevent e JOIN accounts_tenant n ON n.id = e.tenant_id "
                                "WHERE n.slug = %s AND e.type = 'receipt.recorded' "
                                "AND e.recorded_at > to_timestamp(%s) LIMIT 1", (tenant_slug, healed)))

    record.recovery_seconds = wait_until(receipt_after, limit)
    if record.recovery_seconds is None:
        record.fail(f"no receipt within {limit:.0f} s of the heal ({waiting} tasks not finished)")
    return record


def postgres_restart(pgdata: Path, log: Path, down_seconds: float, url: str, web: str,
                     limit: float = 180.0) -> FaultRecord:
    """Stop the PostgreSQL of ``pgdata`` (fast shutdown), keep it down ``down_seconds``, start it
    again with its previous options (``log``: pg_ctl's log, inside ``pgdata``, which the server's
    user can write); measure the time to the next recorded event and to web's ``/healthz`` 200.
    Raises what pgserver raises when the server cannot be started again at all."""
    moving = query(url, "SELECT count(*) FROM tasks_task WHERE status = ANY(%s)",
                   ([*MOVING, "WAITING_RECONCILIATION"],))[0][0]
    record = FaultRecord("postgres_restart", "postgresql", time.time(), held=moving)
    stopped = pg_ctl(pgdata, "-m", "fast", "-w", "stop")
    if stopped.returncode != 0:
        record.ended = time.time()
        record.fail(f"pg_ctl stop failed ({(stopped.stdout + stopped.stderr).strip()[-200:]})", taken=False)
        return record
    try:  # a stop that "succeeded" on another data directory leaves the run's server up
        query(url, "SELECT 1")
    except psycopg.OperationalError:
        pass
    else:
        record.ended = time.time()
        record.fail("PostgreSQL still answered after pg_ctl stop", taken=False)
        return record
    time.sleep(down_seconds)
    # restart: starts a stopped server with the options of its last start (postmaster.opts)
    done = pg_ctl(pgdata, "-w", "-l", str(log), "restart")
    if done.returncode != 0:
        import pgserver

        pgserver.get_server(pgdata, cleanup_mode=None)  # start it as pgserver does, or raise
        record.note = f"pg_ctl restart failed ({done.stdout.strip()[-200:]}); started by pgserver instead"
    record.ended = time.time()
    back = record.ended
    note = record.note

    def first_event_after() -> float | None:
        """When (epoch seconds) the first event after the server was back was recorded, or None."""
        at = query(url, "SELECT extract(epoch FROM min(recorded_at)) FROM events_taskevent "
                        "WHERE recorded_at > to_timestamp(%s)", (back,))[0][0]
        return None if at is None else float(at)

    def healthy() -> bool:
        return httpx.get(f"{web}/healthz", timeout=3).status_code == 200

    started = time.monotonic()
    record.healthz_seconds = wait_until(healthy, limit, step=0.2)
    if not moving:
        record.note = "no task was moving when it stopped"
        return record
    # the event's own recorded_at, not the time this loop saw it: the /healthz wait above came first
    after = wait_until(lambda: first_event_after() is not None, max(1.0, limit - (time.monotonic() - started)),
                       step=0.2)
    if after is None or record.healthz_seconds is None:
        record.fail(f"not recovered within {limit:.0f} s (event: {after}, healthz: {record.healthz_seconds})")
    else:
        record.recovery_seconds = max(0.0, first_event_after() - back)
    if note and record.note != note:
        record.note = f"{note}; {record.note}"
    return record


def pg_ctl(pgdata: Path, *args: str) -> subprocess.CompletedProcess:
    """Run pgserver's ``pg_ctl -D pgdata args`` (as the ``pgserver`` user when root, as pgserver
    runs the server); never raises for its exit status."""
    from pgserver._commands import POSTGRES_BIN_PATH

    return subprocess.run([str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(pgdata), *args],  # noqa: S603
                          capture_output=True, text=True, check=False, timeout=120,
                          user="pgserver" if os.geteuid() == 0 else None)
