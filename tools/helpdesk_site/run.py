"""Preparing and starting the helpdesk project as its own process (used by ``make up`` and by
the tests). Everything runs as a subprocess with the helpdesk's own settings module, so nothing
of faultdesk's Django configuration leaks into it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SETTINGS = "tools.helpdesk_site.settings"
ROOT = Path(__file__).resolve().parents[2]
#: gunicorn kills a request after this many seconds; HELPDESK_REQUEST_LIFETIME_SECONDS adds a margin.
REQUEST_TIMEOUT_SECONDS = 30


def helpdesk_env(var_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of every helpdesk process: its settings and its own var directory."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "HELPDESK_VAR_DIR": str(var_dir), **extra}
    env.pop("DATABASE_URL", None)
    return env


def prepare(var_dir: Path, token: str, *, site_domain: str = "127.0.0.1") -> None:
    """Migrate the helpdesk's SQLite database under ``var_dir`` and create (idempotently) the queue,
    the ``faultdesk_key`` custom field with its unique index, and the staff API user with ``token``
    (40 characters). Raises ``subprocess.CalledProcessError`` with the output on failure."""
    env = helpdesk_env(var_dir)
    base = [sys.executable, "-m", "tools.helpdesk_site"]
    subprocess.run([*base, "migrate", "--no-input", "-v", "0"], cwd=ROOT, env=env, check=True,  # noqa: S603
                   capture_output=True)
    subprocess.run([*base, "hd_bootstrap", "--site-domain", site_domain, "--queue", "faults:Device faults",  # noqa: S603
                    "--custom-field", "faultdesk_key:varchar:200", "--unique-field", "faultdesk_key",
                    "--user", "faultdesk", "--token", token], cwd=ROOT, env=env, check=True, capture_output=True)


def gunicorn_command(port: int, *, workers: int = 2, timeout: int = REQUEST_TIMEOUT_SECONDS) -> list[str]:
    """The command line that serves the helpdesk on 127.0.0.1:``port``; gunicorn kills a request
    after ``timeout`` seconds (keep HELPDESK_REQUEST_LIFETIME_SECONDS above it)."""
    return [str(Path(sys.executable).parent / "gunicorn"), "tools.helpdesk_site.wsgi", "-b",
            f"127.0.0.1:{port}", "-w", str(workers), "--timeout", str(timeout)]
