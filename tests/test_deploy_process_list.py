"""The process list for a plain host, started as a host would start it: the Procfile under honcho,
with the PRODUCTION settings and a complete environment (the test database, the test Redis as
broker and coordination cache, generated secrets, the reference ticket service behind TLS).

It shows the product up: the release step migrates (and refuses to run without a secret, naming
it); web answers /healthz; each queue's worker answers a Celery ping through the entry script's own
healthcheck (which fails while no worker runs); beat sends its ticks and a worker consumes them;
and a fault report filed over the HTTP API reaches COMPLETED with the ticket system's receipt; the
entry script's `check` is clean and its `purge` runs to the end.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import BIN, broker_url, database_url, flush_broker, free_port
from tests.test_e2e import seed_acme

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent
HONCHO = BIN / "honcho"
#: the Procfile's long-running processes, web first (honcho gives the first one the base port)
PROCESSES = ["web", "worker-agent", "worker-tools", "worker-outbox", "worker-maintenance", "beat"]
QUEUES = ["agent", "tools", "outbox", "maintenance"]


def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def _trust(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def _write_env(path: Path, env: dict[str, str]) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return path


def _honcho(args: list[str], env_file: Path) -> list[str]:
    """honcho's command line for the repository's Procfile with ``env_file`` as the environment."""
    return [str(HONCHO), "-f", str(ROOT / "Procfile"), "-d", str(ROOT), "-e", str(env_file), *args]


def _entry(argv: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """deploy/run.sh ARGV as the host would run it, with ``env`` only."""
    return subprocess.run(_entry_cmd(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture
def production_env(transactional_db, tmp_path):
    """A complete production environment: the test database, the test Redis, generated secrets;
    ``REFSERVICE_URL`` a port the ``production`` fixture serves the reference service on, behind TLS
    with a self-signed certificate the processes trust (``SSL_CERT_FILE``)."""
    broker = broker_url()
    flush_broker(broker)
    cert = tmp_path / "cert.pem"
    env = {
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "ENV_FILE": "",
        "PATH": f"{BIN}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "DJANGO_CSRF_TRUSTED_ORIGINS": "https://127.0.0.1",
        "FAULTDESK_PUBLIC_BASE_URL": "https://faultdesk.example.com",
        "DATABASE_URL": database_url(),
        "REDIS_URL": broker,
        "CELERY_BROKER_URL": broker,
        "REFSERVICE_URL": f"https://127.0.0.1:{free_port()}",
        "REFSERVICE_API_KEY": secrets.token_urlsafe(24),
        "REFSERVICE_WEBHOOK_SECRET": secrets.token_urlsafe(32),
        "HELPDESK_URL": "https://helpdesk.invalid",
        "HELPDESK_API_TOKEN": secrets.token_hex(20),
        "FAULTDESK_METRICS_TOKEN": secrets.token_urlsafe(24),
        # notifications go to an SMTP port nothing listens on: they are retried, nothing else waits on them
        "EMAIL_HOST": "127.0.0.1",
        "EMAIL_PORT": str(free_port()),
        "SSL_CERT_FILE": str(cert),
        "FAULTDESK_VAR_DIR": str(tmp_path / "var"),
        "WEB_CONCURRENCY": "1",
        "WORKER_CONCURRENCY": "1",
        "LOG_LEVEL": "INFO",
    }
    try:
        yield env
    finally:
        flush_broker(broker)


@pytest.fixture
def production(production_env, tmp_path):
    """:func:`production_env` with the reference ticket service up behind TLS at its ``REFSERVICE_URL``."""
    env = production_env
    cert, key = _certificate(tmp_path)
    assert str(cert) == env["SSL_CERT_FILE"]
    ref_url = env["REFSERVICE_URL"]
    ref_log = open(tmp_path / "refservice.log", "wb")  # noqa: SIM115 - closed below
    ref = subprocess.Popen([sys.executable, "-m", "tests.tls_refservice", "--port", ref_url.rsplit(":", 1)[1],  # noqa: S603
                            "--db", str(tmp_path / "tickets.sqlite3"), "--cert", str(cert), "--key", str(key),
                            "--api-key", env["REFSERVICE_API_KEY"]], cwd=ROOT, stdout=ref_log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{ref_url}/healthz", verify=_trust(cert), timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                assert ref.poll() is None and time.monotonic() < deadline, (tmp_path / "refservice.log").read_text()
                time.sleep(0.2)
        yield env, cert, ref_url
    finally:
        os.killpg(ref.pid, signal.SIGTERM)
        ref.wait(timeout=20)
        ref_log.close()


def _spawn(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # noqa: S603
                            text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _entry_cmd(argv: list[str]) -> list[str]:
    return ["bash", str(ROOT / "deploy" / "run.sh"), *argv]


def _stop(honcho: subprocess.Popen, output: Path) -> None:
    """Stop honcho (it stops its processes), then any process group it reported that is still alive."""
    if honcho.poll() is None:
        honcho.send_signal(signal.SIGTERM)
        try:
            honcho.wait(timeout=40)
        except subprocess.TimeoutExpired:
            honcho.kill()
            honcho.wait()
    for pid in re.findall(r"started with pid (\d+)", output.read_text(errors="replace")):
        try:
            os.killpg(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_the_release_step_refuses_to_run_without_a_secret_and_names_it(production_env, tmp_path):
    env = production_env
    env_file = _write_env(tmp_path / "incomplete.env", {k: v for k, v in env.items() if k != "DJANGO_SECRET_KEY"})
    done = subprocess.run(_honcho(["start", "release"], env_file), cwd=ROOT, env={"PATH": env["PATH"]},
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode != 0, done.stdout[-3000:]
    assert "(faultdesk.E001) DJANGO_SECRET_KEY is not set" in done.stdout, done.stdout[-3000:]


def test_the_procfile_under_production_settings_serves_a_report_to_completion(production, tmp_path):
    env, cert, ref_url = production
    env_file = _write_env(tmp_path / "production.env", env)
    # at once: the release step (the deploy checks, then migrate: the test database is migrated already,
    # nothing to apply); the worker healthcheck with no worker running (it must fail: it would not pass
    # for a dead worker); the seed (tenant, users, device, knowledge) in this process
    release = _spawn(_honcho(["start", "release"], env_file), {"PATH": env["PATH"]})
    no_worker = _spawn(_entry_cmd(["healthcheck", "worker", "agent"]), {**env, "HEALTHCHECK_TIMEOUT": "2"})
    tenant, requester, device = seed_acme(auto_approve=True)
    done = _finish(release, 180)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "No migrations to apply" in done.stdout, done.stdout[-3000:]
    missing = _finish(no_worker, 60)
    assert missing.returncode != 0, missing.stdout + missing.stderr

    web_port = free_port()
    output = tmp_path / "honcho.log"
    with open(output, "wb") as log:
        honcho = subprocess.Popen(_honcho(["start", "-p", str(web_port), *PROCESSES], env_file),  # noqa: S603
                                  cwd=ROOT, env={"PATH": env["PATH"]}, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        web = f"http://127.0.0.1:{web_port}"
        deadline = time.monotonic() + 120
        while True:
            assert honcho.poll() is None, output.read_text(errors="replace")[-5000:]
            try:
                if httpx.get(f"{web}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, output.read_text(errors="replace")[-5000:]
            time.sleep(0.5)
        assert _entry(["healthcheck", "web"], {**env, "PORT": str(web_port)}).returncode == 0

        # each queue's worker answers a ping addressed to it (QUEUE@host), through the entry script
        pending, deadline = set(QUEUES), time.monotonic() + 90
        while pending:
            pings = {q: _spawn(_entry_cmd(["healthcheck", "worker", q]), {**env, "HEALTHCHECK_TIMEOUT": "3"})
                     for q in pending}
            for queue, proc in pings.items():
                pinged = _finish(proc, 60)
                if pinged.returncode == 0:
                    assert f"{queue}@" in pinged.stdout and "pong" in pinged.stdout, pinged.stdout
                    pending.discard(queue)
            assert not pending or time.monotonic() < deadline, (pending, output.read_text(errors="replace")[-5000:])

        # a report over the API, as a client behind the TLS proxy sends it
        riley = httpx.Client(base_url=web, auth=("riley", "pw-for-tests"), timeout=30,
                             headers={"X-Forwarded-Proto": "https"})
        created = riley.post("/api/tasks/", json={"device_id": device.pk, "urgency": "high",
                                                  "symptom": "Fuser error after warm-up; pages smeared."})
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        deadline = time.monotonic() + 180
        while (body := riley.get(f"/api/tasks/{task_id}/").raise_for_status().json())["status"] not in (
                "COMPLETED", "FAILED", "CANCELLED"):
            assert time.monotonic() < deadline, (body["status"], output.read_text(errors="replace")[-8000:])
            time.sleep(0.5)
        assert body["status"] == "COMPLETED", (body.get("termination_reason"),
                                               output.read_text(errors="replace")[-8000:])
        ticket = body["receipt"]["external_id"]
        held = httpx.get(f"{ref_url}/tickets/{ticket}", verify=_trust(cert), timeout=10,
                         headers={"Authorization": f"Bearer {env['REFSERVICE_API_KEY']}"})
        assert held.status_code == 200, held.text

        # beat ticks, and the outbox worker takes its ticks (beat's schedule file is in the data directory)
        deadline = time.monotonic() + 30
        while True:
            text = output.read_text(errors="replace")
            beat_sent = re.search(r"^\S+ beat\.1 +\| .*Sending due task outbox-tick", text, re.M)
            outbox_took = re.search(r"^\S+ worker-outbox\.1 +\| .*Task dispatch_pending\[[0-9a-f-]+\] succeeded", text,
                                    re.M)
            if beat_sent and outbox_took:
                break
            assert time.monotonic() < deadline, text[-5000:]
            time.sleep(1)
        assert any((tmp_path / "var" / "run").glob("celerybeat-schedule*"))

        # the entry script's one-shot commands against the running product: the deploy checks are
        # clean (warnings fail it), and a retention purge runs to its end
        checking, purging = _spawn(_entry_cmd(["check"]), env), _spawn(_entry_cmd(["purge"]), env)
        checked, purged = _finish(checking, 120), _finish(purging, 120)
        assert checked.returncode == 0 and "no issues" in checked.stdout, checked.stdout + checked.stderr
        assert purged.returncode == 0 and "purge run complete" in purged.stdout, purged.stdout + purged.stderr
        assert _entry(["healthcheck", "beat"], env).returncode == 0
        assert honcho.poll() is None, output.read_text(errors="replace")[-5000:]
    finally:
        _stop(honcho, output)
