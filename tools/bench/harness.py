"""What every benchmark phase of ``make bench`` shares: the bench database, the processes
it starts, the figures it prints, PostgreSQL's commit counter and the peak RSS of a process tree.

Nothing here asserts a figure: a phase measures, :meth:`Bench.figure` prints one line and keeps the
value for ``var/bench/*.json``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from config import embedded
from config.env import BASE_DIR, VAR_DIR
from tools.procfs import processes

#: Where figures and logs go; the database and Redis database the run owns (recreated / flushed).
#: The three can be moved so that two benches (say, two developers' phases) do not collide.
BENCH_DIR = Path(os.environ.get("FAULTDESK_BENCH_DIR", VAR_DIR / "bench"))
LOG_DIR = BENCH_DIR / "logs"
DATABASE = os.environ.get("FAULTDESK_BENCH_DATABASE", "faultdesk_bench")
REDIS_DB = int(os.environ.get("FAULTDESK_BENCH_REDIS_DB", "9"))
BIN = Path(sys.executable).parent
API_KEY = "bench-refservice-key"
PASSWORD = "bench-password"  # noqa: S105 - a throw-away database


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0–100) of ``values``, interpolated linearly between closest ranks
    (numpy's default); NaN for no values."""
    data = sorted(values)
    if not data:
        return float("nan")
    k = (len(data) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return float(data[lo] + (data[hi] - data[lo]) * (k - lo))


def rss_tree_peak_mb(pid: int) -> tuple[float, float]:
    """``(largest, sum)`` of the peak resident set (``VmHWM``, MiB) over ``pid`` and its living
    descendants, read from ``/proc``. A process that already exited counts nothing."""
    peaks = []
    for p in _process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
        except OSError:
            continue
    return (max(peaks, default=0.0), sum(peaks))


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its living descendants, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for child, ppid, _ in processes():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_tree_seconds(pid: int) -> float:
    """CPU seconds (user + system) spent so far by ``pid``, its living descendants, and the
    descendants that exited and were reaped (``cutime``/``cstime`` of their parents), from
    ``/proc/<pid>/stat``; 0.0 when ``pid`` is gone. The difference of two readings is the CPU a
    process role used in between (a Celery pool child or a PostgreSQL backend that ended in between
    is counted by its parent)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in _process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command: state(0) ppid(1) … utime(11) stime(12) cutime(13) cstime(14)
        total += sum(int(f) for f in fields[11:15])
    return total / tick


def postgres_pid() -> int | None:
    """The embedded PostgreSQL's postmaster pid (``postmaster.pid``'s first line), or None."""
    try:
        return int((embedded.PGDATA / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Bench:
    """One ``make bench`` run: its environment, processes, figures and database counters.

    ``env`` is the environment of every process it starts (the bench database, Redis database 9,
    the reference service on ``ports['ref']``); ``figures`` maps a figure's name to
    ``{"value", "unit", "note"}``; ``peaks`` keeps the largest peak RSS (MiB) seen per role.
    """

    def __init__(self, *, quick: bool = False):
        self.quick = quick
        self.ports = {name: free_port() for name in ("web", "ref", "noop")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, object] = {}
        self.figures: dict[str, dict] = {}
        self.peaks: dict[str, float] = {}
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
            "REFSERVICE_WEBHOOK_SECRET": "bench-webhook-secret",
            "FAULTDESK_MODEL_PROVIDER": "local",
            "LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }

    # --- figures -----------------------------------------------------------------------------

    def figure(self, name: str, value, unit: str = "", note: str = "") -> None:
        """Print ``name  value unit  (note)`` and keep it for the JSON file."""
        if isinstance(value, float):
            value = round(value, 4 if abs(value) < 10 else 2)
        self.figures[name] = {"value": value, "unit": unit, "note": note}
        shown = f"{value:,}" if isinstance(value, int) else (f"{value:,.3f}" if isinstance(value, float) else value)
        print(f"{name:<48} {shown} {unit}" + (f"   ({note})" if note else ""), flush=True)

    def value(self, name: str):
        """A figure's value, or None when the phase did not produce it."""
        return self.figures.get(name, {}).get("value")

    # --- processes ---------------------------------------------------------------------------

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start ``cmd`` in its own session, output to ``var/bench/logs/<name>.log``."""
        log = self.logs.get(name) or open(LOG_DIR / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop_all
        self.logs[name] = log
        self.procs[name] = subprocess.Popen(cmd, cwd=BASE_DIR, env=env or self.env, stdout=log,  # noqa: S603
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self.procs[name]

    def note_peak(self, role: str, name: str) -> float:
        """Record the largest single-process peak RSS (MiB) of process ``name``'s tree under
        ``role``; returns it."""
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return 0.0
        largest, _ = rss_tree_peak_mb(proc.pid)
        self.peaks[role] = max(self.peaks.get(role, 0.0), largest)
        return largest

    def cpu_seconds(self, names) -> dict[str, float]:
        """``{role: CPU seconds so far}`` (:func:`cpu_tree_seconds`) for each running process of
        ``names`` (``web``, ``worker``, ``beat``, ``refservice`` …) and ``postgres`` (the embedded
        server, all its backends)."""
        out = {name: cpu_tree_seconds(self.procs[name].pid) for name in names
               if name in self.procs and self.procs[name].poll() is None}
        pg = postgres_pid()
        if pg is not None:
            out["postgres"] = cpu_tree_seconds(pg)
        return out

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop process ``name`` and its children (SIGTERM, then SIGKILL after 20 s)."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        for log in self.logs.values():
            log.close()
        self.logs.clear()

    def wait_http(self, url: str, timeout: float = 90) -> None:
        """Wait until ``url`` answers 200; SystemExit naming the logs otherwise."""
        from tools.devstack import wait_http

        if not wait_http(url, timeout):
            raise SystemExit(f"{url} did not answer within {timeout:.0f} s; see {LOG_DIR}/*.log")

    def wait_log(self, name: str, needle: str, timeout: float = 120) -> None:
        """Wait until ``needle`` appears in process ``name``'s log."""
        path = LOG_DIR / f"{name}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in path.read_text(errors="replace"):
                return
            if self.procs.get(name) is not None and self.procs[name].poll() is not None:
                raise SystemExit(f"{name} exited; see {path}")
            time.sleep(0.2)
        raise SystemExit(f"{name} did not log {needle!r} within {timeout:.0f} s; see {path}")

    def start_refservice(self, name: str = "refservice") -> None:
        """The reference ticket service on ``ports['ref']`` with a fresh SQLite file."""
        db = BENCH_DIR / f"{name}.sqlite3"
        db.unlink(missing_ok=True)
        self.start(name, [sys.executable, "-m", "tools.refservice", "--port", str(self.ports["ref"]),
                          "--db", str(db), "--api-key", API_KEY, "--log-level", "WARNING"])
        self.wait_http(f"http://127.0.0.1:{self.ports['ref']}/healthz", 30)

    def start_web(self, workers: int = 2, threads: int = 4, env: dict | None = None) -> None:
        """gunicorn serving Django on ``ports['web']`` (as ``make up`` and the chaos run do)."""
        self.start("web", [str(BIN / "gunicorn"), "config.wsgi", "-b", f"127.0.0.1:{self.ports['web']}",
                           "-w", str(workers), "--threads", str(threads), "--timeout", "120"], env=env)
        self.wait_http(f"http://127.0.0.1:{self.ports['web']}/healthz", 90)

    def start_worker(self, concurrency: int, queues: str = "agent,tools,outbox", name: str = "worker",
                     env: dict | None = None, app: str = "config") -> None:
        """One Celery worker node of the Celery ``app`` (a module, ``-A``) on ``queues`` with
        ``concurrency`` prefork processes; returns once it reports ready."""
        self.start(name, [str(BIN / "celery"), "-A", app, "worker", "-Q", queues, "-n", f"{name}-bench@%h",
                          "-c", str(concurrency), "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
                   env=env)
        self.wait_log(name, "ready.", 120)

    def start_beat(self, env: dict | None = None) -> None:
        self.start("beat", [str(BIN / "celery"), "-A", "config", "beat", "-s", str(BENCH_DIR / "beat-schedule"),
                            "--loglevel", "WARNING"], env=env)


class WalCommits:
    """How many transactions committed (and aborted) on the server between :meth:`start` and
    :meth:`stop`: the ``Transaction/COMMIT`` and ``ABORT`` records ``pg_waldump`` finds in the WAL
    between the two positions.

    That is one record per top-level transaction that wrote — the transactions that wait for a WAL
    flush, as pgbench's do — whatever savepoints it used inside; read-only transactions write none.
    A temporary physical replication slot, held by ``conn`` meanwhile, keeps the server from
    recycling that WAL before it is read. The count covers every database of the server."""

    def __init__(self, conn, *, slot: str = "faultdesk_bench_wal"):
        self.conn = conn
        self.slot = slot
        self.start_lsn: str | None = None

    def start(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name = %s", [self.slot])
            if cur.fetchone() is None:
                cur.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", [self.slot])
            cur.execute("SELECT pg_current_wal_lsn()::text")
            self.start_lsn = cur.fetchone()[0]

    def stop(self) -> tuple[int, int]:
        """``(commits, aborts)`` since :meth:`start`; drops the slot. SystemExit when pg_waldump
        cannot read the range. Aborts are a lower bound: PostgreSQL does not flush an abort
        record at once, so the last ones may lie past the written WAL read here."""
        from pgserver._commands import POSTGRES_BIN_PATH

        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text")
            end = cur.fetchone()[0]
        try:
            out = subprocess.run(  # noqa: S603
                [str(POSTGRES_BIN_PATH / "pg_waldump"), "-p", str(embedded.PGDATA / "pg_wal"), "-s", self.start_lsn,
                 "-e", end, "--stats=record"], capture_output=True, text=True, check=False)
        finally:
            with self.conn.cursor() as cur:
                cur.execute("SELECT pg_drop_replication_slot(%s)", [self.slot])
        if self.start_lsn == end:
            return 0, 0
        if out.returncode != 0:
            raise SystemExit(f"pg_waldump {self.start_lsn}..{end} failed: {out.stderr.strip()[-500:]}")
        counts = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) > 1 and parts[0] in ("Transaction/COMMIT", "Transaction/ABORT"):
                counts[parts[0]] = int(parts[1])
        return counts.get("Transaction/COMMIT", 0), counts.get("Transaction/ABORT", 0)


def session_client(base: str, username: str, *, timeout: float = 60) -> httpx.Client:
    """An ``httpx.Client`` logged in to the web at ``base`` as ``username`` through the login form,
    sending the CSRF token on unsafe requests (what a browser does; Basic auth would cost a
    password hash per request)."""
    client = httpx.Client(base_url=base, timeout=timeout, follow_redirects=False)
    client.get("/login/")
    token = client.cookies.get("csrftoken")
    resp = client.post("/login/", data={"username": username, "password": PASSWORD, "csrfmiddlewaretoken": token},
                       headers={"Referer": f"{base}/login/"})
    if resp.status_code != 302:
        raise SystemExit(f"could not log in as {username}: HTTP {resp.status_code}")
    client.headers["X-CSRFToken"] = client.cookies.get("csrftoken")
    client.headers["Referer"] = f"{base}/"
    return client


class SqlStatements:
    """Counts the SQL statements the whole server executes between :meth:`start` and :meth:`stop`,
    the bench's own connection ``conn`` aside: ``log_statement = 'all'`` is switched on for every
    session with ``ALTER SYSTEM`` and a configuration reload (sessions already open pick it up at
    their next command), and the embedded server's log (``var/pgdata/log``) is read from where it
    stood. A statement is a ``statement:`` or ``execute …:`` line (simple and extended protocol);
    ``BEGIN``/``COMMIT``/``ROLLBACK``/``SAVEPOINT``/``RELEASE`` are counted apart. Logging every
    statement slows the server, so measure a quiet part of a run (the reports sent one at a time),
    not the throughput."""

    #: the statement's first word, when it starts on the log line (a statement written as
    #: ``"""\n    SELECT …"""`` starts on the next line: the word is empty, and it is a statement)
    _LINE = re.compile(r"\[(\d+)\] LOG:  (?:statement|execute [^:]*):[ \t]*(\w*)")
    _CONTROL = frozenset({"BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE", "START"})

    def __init__(self, conn):
        self.conn = conn
        self.log = embedded.PGDATA / "log"
        self.offset = 0

    def _set(self, sql: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(sql)
            cur.execute("SELECT pg_reload_conf()")

    def start(self) -> None:
        self.offset = self.log.stat().st_size if self.log.exists() else 0
        self._set("ALTER SYSTEM SET log_statement = 'all'")
        time.sleep(0.5)  # the postmaster signals the backends; each re-reads at its next command

    def stop(self) -> tuple[int, int]:
        """``(statements, transaction-control statements)`` since :meth:`start`; switches
        statement logging off again."""
        time.sleep(0.2)  # the last statements reach the log
        self._set("ALTER SYSTEM RESET log_statement")
        own = str(self.conn.info.backend_pid)
        statements = control = 0
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            for raw in f:
                m = self._LINE.search(raw.decode("utf-8", "replace"))
                if m is None or m.group(1) == own:
                    continue
                if m.group(2).upper() in self._CONTROL:
                    control += 1
                else:
                    statements += 1
        return statements, control
