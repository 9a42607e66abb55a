"""Real processes for end-to-end and crash tests: the reference ticket service, web (gunicorn),
Celery workers and beat, all against the test database and a real broker: Redis, or RabbitMQ
(``Stack(broker="amqp")``, or every stack with ``FAULTDESK_TEST_BROKER=amqp`` in the environment)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from django.conf import settings
from django.db import connection

from config import embedded

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
BROKER_DB = 9
HELPDESK_TOKEN = "e2ehelpdesktoken".ljust(40, "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    """URL of the test database for child processes."""
    s = connection.settings_dict
    opts = s.get("OPTIONS") or {}
    host = s.get("HOST") or opts.get("host") or ""
    port = s.get("PORT") or opts.get("port") or 5432
    user, password = s.get("USER") or "postgres", s.get("PASSWORD") or ""
    if host.startswith("/"):
        return f"postgres://{user}:{password}@/{s['NAME']}?host={host}&port={port}"
    return f"postgres://{user}:{password}@{host}:{port}/{s['NAME']}"


def broker_url(db: int = BROKER_DB) -> str:
    """The broker URL of Redis database ``db`` (the test stacks' own: 9 by default)."""
    if os.environ.get("REDIS_URL"):
        base = os.environ["REDIS_URL"]
        return base.rsplit("/", 1)[0] + f"/{db}" if base.startswith("redis://") else base
    embedded.ensure_redis()
    return embedded.redis_url(db)


def flush_broker(url: str, db: int = BROKER_DB) -> None:
    """Empty the broker at ``url`` (Redis database ``db`` for the embedded socket)."""
    import redis

    if url.startswith("redis+socket://"):
        redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=db).flushdb()
    else:
        redis.Redis.from_url(url).flushdb()


_AMQP: dict[str, str] = {}


def _amqp_broker() -> str:
    """The RabbitMQ broker URL of this test process: a virtual host of its own, made on first use
    (``rabbitmqctl`` takes seconds a call) and dropped when the process exits; each stack starts and
    ends with its queues purged."""
    import atexit

    from tools import rabbitmq

    if "url" not in _AMQP:
        _AMQP["url"] = rabbitmq.fresh_vhost(f"faultdesk_test_{os.getpid()}")
        atexit.register(rabbitmq.drop_vhost, _AMQP["url"])
    else:
        rabbitmq.purge(_AMQP["url"])
    return _AMQP["url"]


def default_broker() -> str:
    """The broker kind of stacks that do not name one: ``FAULTDESK_TEST_BROKER`` (``redis`` or
    ``amqp``), ``redis`` when unset. Raises ``ValueError`` for another value."""
    kind = os.environ.get("FAULTDESK_TEST_BROKER", "redis") or "redis"
    if kind not in ("redis", "amqp"):
        raise ValueError(f"FAULTDESK_TEST_BROKER={kind!r}: expected 'redis' or 'amqp'")
    return kind


class Stack:
    """Named child processes sharing one environment; logs in ``log_dir``. ``broker`` is ``redis``
    (Redis database 9) or ``amqp`` (the test process's RabbitMQ virtual host, purged at the start and
    at :meth:`stop_all`; Redis then holds only the coordination hints); None: :func:`default_broker`."""

    def __init__(self, log_dir: Path, broker: str | None = None, **env_extra: str):

        self.log_dir = log_dir
        self.web_port, self.ref_port = free_port(), free_port()
        self.hd_port, self.proxy_port = free_port(), free_port()
        self.broker_kind = broker or default_broker()
        self.redis = broker_url()
        flush_broker(self.redis)
        self.broker = _amqp_broker() if self.broker_kind == "amqp" else self.redis
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "config.settings.local",
            "DJANGO_DEBUG": "false",
            # one load-generating client per role: the API's per-user rate is for people, not this
            "FAULTDESK_API_RATE_USER": "1000000/minute",
            "DATABASE_URL": database_url(),
            "REDIS_URL": self.redis,
            "CELERY_BROKER_URL": self.broker,
            "REFSERVICE_URL": f"http://127.0.0.1:{self.ref_port}",
            "REFSERVICE_API_KEY": "e2e-key",
            "FAULTDESK_PUBLIC_BASE_URL": f"http://127.0.0.1:{self.web_port}",
            # django-helpdesk (started by start_helpdesk), reached through the fault proxy; its
            # gunicorn kills a request after 10 s, so 15 s is a safe request lifetime.
            "HELPDESK_URL": f"http://127.0.0.1:{self.proxy_port}",
            "HELPDESK_API_TOKEN": HELPDESK_TOKEN,
            "HELPDESK_REQUEST_LIFETIME_SECONDS": "15",
            "REFSERVICE_WEBHOOK_SECRET": "e2e-webhook-secret",
            "REFSERVICE_WEBHOOK_URL": f"http://127.0.0.1:{self.web_port}/webhooks/reference/",
            "PYTHONUNBUFFERED": "1",
            # The test settings' hashers (MD5 first): users made in-process sign in to the server
            # processes as they are, and a basic-auth poll does not cost a PBKDF2 check each time.
            "DJANGO_PASSWORD_HASHERS": ",".join(settings.PASSWORD_HASHERS),
            **env_extra,
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}

    @property
    def web(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def ref(self) -> str:
        return f"http://127.0.0.1:{self.ref_port}"

    def start(self, name: str, cmd: list[str], **env_extra: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop_all
        self._logs[name] = log
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, **env_extra}, stdout=log,  # noqa: S603
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_refservice(self) -> None:
        self.start("refservice", [sys.executable, "-m", "tools.refservice", "--host", "127.0.0.1",
                                  "--port", str(self.ref_port), "--db", str(self.log_dir / "tickets.sqlite3"),
                                  "--api-key", "e2e-key"])
        self.wait_http(f"{self.ref}/healthz", 30)

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def start_helpdesk(self) -> None:
        """A real django-helpdesk (own settings, own SQLite) and the fault proxy in front of it."""
        from tools.helpdesk_site import run as helpdesk

        var = self.log_dir / "helpdesk"
        helpdesk.prepare(var, HELPDESK_TOKEN)
        self.start("helpdesk", helpdesk.gunicorn_command(self.hd_port, timeout=10),
                   DJANGO_SETTINGS_MODULE=helpdesk.SETTINGS, HELPDESK_VAR_DIR=str(var))
        self.start("faultproxy", [sys.executable, "-m", "tools.faultproxy", "--port", str(self.proxy_port),
                                  "--upstream", f"http://127.0.0.1:{self.hd_port}",
                                  "--fault-prefix", "/helpdesk/api/tickets/"])
        self.wait_http(f"{self.proxy}/helpdesk/login/", 60)

    def start_web(self) -> None:
        self.start("web", [str(BIN / "gunicorn"), "config.wsgi", "-b", f"127.0.0.1:{self.web_port}", "-w", "2",
                           "--threads", "2"])
        self.wait_http(f"{self.web}/healthz", 60)

    def start_worker(self, name: str, *, queues: str = "agent,tools,outbox", pool: str = "prefork",
                     concurrency: int = 2, **env_extra: str) -> subprocess.Popen:
        cmd = [str(BIN / "celery"), "-A", "config", "worker", "-Q", queues, "-n", f"{name}-{self.web_port}@%h",
               "--loglevel", "INFO", "-P", pool]
        if pool != "solo":
            cmd += ["-c", str(concurrency)]
        return self.start(name, cmd, **env_extra)

    def start_beat(self) -> None:
        self.start("beat", [str(BIN / "celery"), "-A", "config", "beat", "-s", str(self.log_dir / "beat-schedule"),
                            "--loglevel", "INFO"])

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name in ("web", "refservice"):
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log(name)[-2000:]}")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(url)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.log_dir.glob("*.log"))

    def wait_exit(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def stop(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop_all(self) -> None:
        """Stop every process: SIGTERM to all at once (each shuts down gracefully, side by side),
        then SIGKILL whatever has not exited 20 s later."""
        running = [proc for proc in self.procs.values() if proc.poll() is None]
        for proc in running:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in self._logs.values():
            log.close()
        flush_broker(self.redis)
        if self.broker_kind == "amqp":
            from tools import rabbitmq

            rabbitmq.purge(self.broker)


@contextmanager
def running_stack(log_dir: Path, broker: str | None = None, **env_extra: str):
    """A :class:`Stack` (on ``broker``: ``redis``, ``amqp``, None for :func:`default_broker`) with the
    reference service, web and beat up (workers are the test's to start); every process is stopped
    on exit."""
    stack = Stack(log_dir, broker, **env_extra)
    try:
        stack.start_refservice()
        stack.start_web()
        stack.start_beat()
        yield stack
    finally:
        stack.stop_all()


@contextmanager
def demo_stack(log_dir: Path, *, helpdesk: bool = False):
    """``make demo``'s processes against the test database, seeded as ``make demo`` seeds it: the
    reference service, web, one worker on every queue, beat and (with ``helpdesk``) django-helpdesk
    behind the fault proxy; :func:`tools.demo_data.seed` has run, with its passwords in
    ``log_dir / "demo-credentials.json"``. Yields ``(stack, credentials_path)``; every process is
    stopped on exit. The caller holds a transactional database (the processes must see the seed)."""
    from tools.demo_data import seed

    credentials = log_dir / "demo-credentials.json"
    seed(credentials_path=credentials, write=lambda line: None)
    stack = Stack(log_dir)
    try:
        stack.start_refservice()
        if helpdesk:
            stack.start_helpdesk()
        stack.start_web()
        stack.start_worker("worker")
        stack.start_beat()
        yield stack, credentials
    finally:
        stack.stop_all()


@contextmanager
def helpdesk_running(var: Path, token: str):
    """A real django-helpdesk (gunicorn, its own SQLite under ``var``) whose API answers ``token``;
    yields its base URL once its ticket API answers 200 (within 60 s, else the test fails with the
    end of its log), and stops it afterwards."""
    from tools.helpdesk_site import run as helpdesk

    helpdesk.prepare(var, token)
    port = free_port()
    log = open(var / "gunicorn.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(helpdesk.gunicorn_command(port), cwd=helpdesk.ROOT,  # noqa: S603
                            env=helpdesk.helpdesk_env(var), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(f"{base}/helpdesk/api/tickets/", headers={"Authorization": f"Token {token}"},
                             timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (var / "gunicorn.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "helpdesk did not start"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
