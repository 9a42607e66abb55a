"""Phase 1, the ceiling: how many transactions per second this PostgreSQL server commits on this
machine — pgbench's simple-update script (``-N``: one UPDATE, one SELECT, one INSERT per
transaction), several clients, in a database of its own on the same server as faultdesk's."""

from __future__ import annotations

import re
import subprocess

from config import embedded
from tools.bench.harness import LOG_DIR, Bench

DATABASE = "faultdesk_pgbench"


def _pg(server_bin, name: str) -> str:
    return str(server_bin / name)


def run(bench: Bench, *, clients: int = 8, seconds: int = 20, scale: int = 10) -> None:
    """Initialise pgbench (scale ``scale``), run simple-update with ``clients`` clients for
    ``seconds`` s and with 1 client for a third of that; figures ``ceiling.*``.

    Raises SystemExit when pgbench fails (its output is in ``var/bench/logs/pgbench.log``)."""
    import pgserver
    from pgserver._commands import POSTGRES_BIN_PATH
    from pgserver.utils import PostmasterInfo

    server = pgserver.get_server(embedded.PGDATA, cleanup_mode=None)
    server.psql(f'SET client_min_messages = warning; DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE);')
    server.psql(f'CREATE DATABASE "{DATABASE}";')
    info = PostmasterInfo.read_from_pgdata(embedded.PGDATA)
    conn = ["-h", str(info.socket_dir), "-p", str(info.port or 5432), "-U", "postgres"]
    pgbench = _pg(POSTGRES_BIN_PATH, "pgbench")
    log = LOG_DIR / "pgbench.log"

    def call(*args: str) -> str:
        out = subprocess.run([pgbench, *conn, *args, DATABASE], capture_output=True, text=True, check=False)  # noqa: S603
        with log.open("a") as f:
            f.write(f"$ pgbench {' '.join(args)}\n{out.stdout}\n{out.stderr}\n")
        if out.returncode != 0:
            raise SystemExit(f"pgbench {' '.join(args)} failed; see {log}")
        return out.stdout + out.stderr

    call("-i", "-q", "-s", str(scale))
    settings = {row.split("|")[0]: row.split("|")[1] for row in server.psql(
        "SELECT name || '|' || setting FROM pg_settings WHERE name IN "
        "('synchronous_commit', 'fsync', 'wal_sync_method', 'shared_buffers', 'max_connections')").split("\n")
        if "|" in row}
    settings = {k.strip(): v.strip() for k, v in settings.items()}
    note = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    many = call("-N", "-c", str(clients), "-j", "2", "-T", str(seconds), "-n")
    one = call("-N", "-c", "1", "-j", "1", "-T", str(max(3, seconds // 3)), "-n")
    tps_many = _tps(many)
    bench.figure("ceiling.commits_per_s", tps_many, "commits/s",
                 f"pgbench -N, {clients} clients, {seconds} s, scale {scale}; {note}")
    bench.figure("ceiling.latency_ms", _latency(many), "ms", f"average transaction at {clients} clients")
    bench.figure("ceiling.commits_per_s_1_client", _tps(one), "commits/s", "pgbench -N, 1 client")
    server.psql(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE);')


def _tps(output: str) -> float:
    match = re.search(r"tps = ([0-9.]+) \((?:without initial connection time|excluding connections)", output)
    if not match:
        raise SystemExit(f"pgbench printed no tps:\n{output[-1500:]}")
    return float(match.group(1))


def _latency(output: str) -> float:
    match = re.search(r"latency average = ([0-9.]+) ms", output)
    return float(match.group(1)) if match else float("nan")
