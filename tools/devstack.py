"""Start and stop faultdesk's processes on one machine (``make up`` / ``make down`` / ``make demo``).

Processes (DESIGN.md §2), run under supervisord with logs in ``var/log``:

- ``web``: gunicorn serving Django on ``FAULTDESK_WEB_PORT`` (8000);
- ``worker-agent``, ``worker-tools``, ``worker-outbox``, ``worker-maintenance``: one Celery worker per queue;
- ``beat``: Celery beat (outbox tick, lease sweeper, reconciler, approval expiry);
- ``refservice``: the reference ticket service on ``REFSERVICE_PORT`` (8765), storage in
  ``var/refservice``;
- ``model``: an OpenAI-compatible model server on ``MODEL_PORT`` (8767), chosen by
  ``FAULTDESK_MODEL_SERVER``: ``scripted`` (the default, :mod:`tools.scripted_model_server`) or
  ``llama`` (the real SmolLM2-135M-Instruct under llama.cpp, :mod:`tools.modelserver`; ``make
  model`` builds it), which web and the workers then draft with.

PostgreSQL and Redis are embedded unless ``DATABASE_URL`` / ``REDIS_URL`` are set. The broker is
Redis unless ``CELERY_BROKER_URL`` names another (``amqp://guest:guest@127.0.0.1:5672//`` for the
machine's RabbitMQ); Redis then keeps only the coordination hints.

Usage: ``python -m tools.devstack up|down|status|demo [--no-wait] [--tenant acme|initech]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from config import embedded
from config.env import BASE_DIR, VAR_DIR
from tools import demo_client, modelserver
from tools.helpdesk_site import run as helpdesk_site

BIN = Path(sys.executable).parent
RUN = VAR_DIR / "run"
LOGS = VAR_DIR / "log"
CONF = RUN / "supervisord.conf"
SOCK = RUN / "supervisor.sock"
DEMO_PID = RUN / "demo.pid"


def web_port() -> int:
    return int(os.environ.get("FAULTDESK_WEB_PORT", "8000"))


def refservice_port() -> int:
    return int(os.environ.get("REFSERVICE_PORT", "8765"))


def helpdesk_port() -> int:
    return int(os.environ.get("HELPDESK_PORT", "8766"))


def model_port() -> int:
    return int(os.environ.get("MODEL_PORT", "8767"))


HELPDESK_VAR = VAR_DIR / "helpdesk"

SCRIPTED, LLAMA = "scripted", "llama"
#: per call, for the real 135M model on 2 CPU cores: a ticket draft alone takes p50 7 s, p95 37 s, at
#: most 47 s (make bench-model, docs/real-model.md), and the server answers one request at a time, so a
#: call may wait for another; the agent bounds it by the lease too (55 s) and the task's deadline
LLAMA_TIMEOUT_SECONDS = "50"


def model_server() -> str:
    """Which model server ``make up`` runs on ``MODEL_PORT``: ``FAULTDESK_MODEL_SERVER``, ``scripted``
    (the default) or ``llama``. Exits with a message for any other value."""
    kind = os.environ.get("FAULTDESK_MODEL_SERVER", SCRIPTED).strip().lower() or SCRIPTED
    if kind not in (SCRIPTED, LLAMA):
        raise SystemExit(f"FAULTDESK_MODEL_SERVER must be {SCRIPTED!r} or {LLAMA!r}, not {kind!r}")
    return kind


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    env.setdefault("REFSERVICE_URL", f"http://127.0.0.1:{refservice_port()}")
    env.setdefault("REFSERVICE_API_KEY", "faultdesk-refservice-dev-key")
    env.setdefault("FAULTDESK_PUBLIC_BASE_URL", f"http://127.0.0.1:{web_port()}")
    # Status changes of reference tickets come back as signed webhooks (DESIGN.md §11).
    env.setdefault("REFSERVICE_WEBHOOK_SECRET", "faultdesk-webhook-dev-secret")
    env.setdefault("REFSERVICE_WEBHOOK_URL", f"http://127.0.0.1:{web_port()}/webhooks/reference/")
    env.setdefault("HELPDESK_URL", f"http://127.0.0.1:{helpdesk_port()}")
    env.setdefault("HELPDESK_API_TOKEN", "faultdeskhelpdeskdevtoken000000000000000")
    # The model server make up runs: the scripted one serves FAULTDESK_MODEL_PROVIDER=openai_compatible
    # when asked for; the real one (FAULTDESK_MODEL_SERVER=llama) is what web and the workers draft with.
    env.setdefault("FAULTDESK_MODEL_BASE_URL", f"http://127.0.0.1:{model_port()}/v1")
    if model_server() == LLAMA:
        env.setdefault("FAULTDESK_MODEL_PROVIDER", "openai_compatible")
        env.setdefault("FAULTDESK_MODEL_NAME", modelserver.MODEL_ALIAS)
        env.setdefault("FAULTDESK_MODEL_TIMEOUT_SECONDS", LLAMA_TIMEOUT_SECONDS)
        # llama-cpp-python's server takes structured output only as {"type": "json_object", "schema": …}
        # (it answers OpenAI's json_schema form with a 500; docs/real-model.md): the provider's choice
        env.setdefault("FAULTDESK_MODEL_RESPONSE_FORMAT", "json_object")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def programs() -> dict[str, str]:
    """Program name → command line (run from the repository root)."""
    celery = f"{BIN / 'celery'} -A config"
    return {
        "web": f"{BIN / 'gunicorn'} config.wsgi -b 127.0.0.1:{web_port()} -w 2 --threads 4 --timeout 60 "
               f"--access-logfile -",
        "worker-agent": f"{celery} worker -Q agent -n agent@%%h -c 2 --loglevel INFO",
        "worker-tools": f"{celery} worker -Q tools -n tools@%%h -c 2 --loglevel INFO",
        "worker-outbox": f"{celery} worker -Q outbox -n outbox@%%h -c 2 --loglevel INFO",
        # the retention purge: one slot of its own, so a purge never waits behind or holds up the hot path
        "worker-maintenance": f"{celery} worker -Q maintenance -n maintenance@%%h -c 1 --loglevel INFO",
        "beat": f"{celery} beat --loglevel INFO -s {RUN / 'celerybeat-schedule'} --pidfile=",
        "refservice": f"{sys.executable} -m tools.refservice --host 127.0.0.1 --port {refservice_port()} "
                      f"--db {VAR_DIR / 'refservice' / 'tickets.sqlite3'}",
        # the OpenAI-compatible model server: scripted, or the real local model (FAULTDESK_MODEL_SERVER)
        "model": _model_command(),
        # django-helpdesk, the second ticket system: its own project, settings and SQLite file.
        "helpdesk": " ".join(helpdesk_site.gunicorn_command(helpdesk_port())),
    }


def _model_command() -> str:
    """The ``model`` program's command line for :func:`model_server`. The real server checks the
    bearer key the product sends (``FAULTDESK_MODEL_API_KEY``, the development key by default)."""
    if model_server() == LLAMA:
        key = os.environ.get("FAULTDESK_MODEL_API_KEY", modelserver.DEV_API_KEY)
        return " ".join(modelserver.command(port=model_port(), api_key=key))
    return f"{sys.executable} -m tools.scripted_model_server --host 127.0.0.1 --port {model_port()}"


def write_supervisor_conf() -> None:
    env = _env()
    keep = ("DJANGO_SETTINGS_MODULE", "REFSERVICE_URL", "REFSERVICE_API_KEY", "FAULTDESK_PUBLIC_BASE_URL",
            "REFSERVICE_WEBHOOK_SECRET", "REFSERVICE_WEBHOOK_URL",
            "PYTHONUNBUFFERED", "DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "PATH", "HOME", "DJANGO_SECRET_KEY",
            "FAULTDESK_MODEL_PROVIDER", "FAULTDESK_MODEL_BASE_URL", "FAULTDESK_MODEL_API_KEY", "FAULTDESK_MODEL_NAME",
            "FAULTDESK_MODEL_TIMEOUT_SECONDS", "FAULTDESK_MODEL_MAX_OUTPUT_TOKENS", "FAULTDESK_MODEL_RESPONSE_FORMAT",
            "HELPDESK_URL", "HELPDESK_API_TOKEN")
    env_line = ",".join(f'{k}="{env[k]}"' for k in keep if k in env)
    # The helpdesk is another Django project: its own settings module and var directory.
    helpdesk_env = helpdesk_site.helpdesk_env(HELPDESK_VAR)
    helpdesk_line = ",".join(f'{k}="{helpdesk_env[k]}"' for k in
                             ("DJANGO_SETTINGS_MODULE", "HELPDESK_VAR_DIR", "PATH", "HOME", "PYTHONUNBUFFERED")
                             if k in helpdesk_env)
    lines = [
        "[unix_http_server]", f"file={SOCK}", "",
        "[supervisord]", f"logfile={LOGS / 'supervisord.log'}", f"pidfile={RUN / 'supervisord.pid'}",
        f"directory={BASE_DIR}", "nodaemon=false", "",
        "[rpcinterface:supervisor]", "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "", "[supervisorctl]", f"serverurl=unix://{SOCK}", "",
    ]
    for name, cmd in programs().items():
        lines += [
            f"[program:{name}]", f"command={cmd}", f"directory={BASE_DIR}",
            f"environment={helpdesk_line if name == 'helpdesk' else env_line}",
            "autostart=true", "autorestart=true", "startsecs=2", "stopasgroup=true", "killasgroup=true",
            "stopwaitsecs=20", f"stdout_logfile={LOGS / (name + '.log')}", "redirect_stderr=true", "",
        ]
    CONF.write_text("\n".join(lines))


def _supervisorctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "supervisorctl"), "-c", str(CONF), *args],  # noqa: S603
                          capture_output=True, text=True, check=False)


def _supervisord_running() -> bool:
    return SOCK.exists() and _supervisorctl("pid").returncode == 0


def wait_http(url: str, timeout: float) -> bool:
    """True once ``url`` answers 200 (polled every 0.3 s), False after ``timeout`` s. Shared by
    ``make up``, the chaos run and the bench."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def _manage(*args: str) -> None:
    subprocess.run([sys.executable, str(BASE_DIR / "manage.py"), *args], check=True, env=_env())  # noqa: S603


def up() -> None:
    """Start every service in the background; return when web, the ticket services and the model
    server answer. With ``FAULTDESK_MODEL_SERVER=llama`` and no ``make model`` yet, exits at once
    saying so."""
    if model_server() == LLAMA and not modelserver.available():
        raise SystemExit("FAULTDESK_MODEL_SERVER=llama needs the local model server, which is not built "
                         f"({modelserver.VENV} is missing or incomplete): run `make model` "
                         "first (about 5 minutes the first time on 2 cores, then from pip's wheel cache)")
    for d in (RUN, LOGS, VAR_DIR / "refservice"):
        d.mkdir(parents=True, exist_ok=True)
    if "DATABASE_URL" not in os.environ:
        print("• embedded PostgreSQL 16 + pgvector in var/pgdata", flush=True)
        embedded.ensure_postgres()
    if "REDIS_URL" not in os.environ:
        print("• embedded Redis on var/run/redis.sock", flush=True)
        embedded.ensure_redis()
    print("• migrating", flush=True)
    _manage("migrate", "--no-input", "-v", "0")
    print("• django-helpdesk in var/helpdesk (its own database)", flush=True)
    helpdesk_site.prepare(HELPDESK_VAR, _env()["HELPDESK_API_TOKEN"], site_domain=f"127.0.0.1:{helpdesk_port()}")
    if _supervisord_running():
        print("• processes already running; restarting them", flush=True)
        _stop_supervisord()
    write_supervisor_conf()
    subprocess.run([str(BIN / "supervisord"), "-c", str(CONF)], check=True)  # noqa: S603
    ok_web = wait_http(f"http://127.0.0.1:{web_port()}/healthz", 60)
    ok_ref = wait_http(f"http://127.0.0.1:{refservice_port()}/healthz", 30)
    ok_hd = wait_http(f"http://127.0.0.1:{helpdesk_port()}/helpdesk/login/", 30)
    if model_server() == LLAMA:  # the real server has no /healthz; it lists the model once it is loaded
        ok_model = modelserver.wait_ready(_env()["FAULTDESK_MODEL_BASE_URL"], timeout=120,
                                          api_key=_env().get("FAULTDESK_MODEL_API_KEY", modelserver.DEV_API_KEY))
    else:
        ok_model = wait_http(f"http://127.0.0.1:{model_port()}/healthz", 30)
    print(_supervisorctl("status").stdout, flush=True)
    if not (ok_web and ok_ref and ok_hd and ok_model):
        raise SystemExit(f"services did not come up (web={ok_web}, refservice={ok_ref}, helpdesk={ok_hd}, "
                         f"model={ok_model}); see var/log/")
    print(f"• web on http://127.0.0.1:{web_port()}/ · reference ticket service on "
          f"http://127.0.0.1:{refservice_port()}/ · django-helpdesk on http://127.0.0.1:{helpdesk_port()}/helpdesk/ "
          f"· {_model_description()} · logs in var/log/", flush=True)


def _model_description() -> str:
    env = _env()
    if model_server() == LLAMA:
        return (f"the real model {modelserver.MODEL_ALIAS} (llama.cpp) on http://127.0.0.1:{model_port()}/v1, "
                f"drafting with provider {env['FAULTDESK_MODEL_PROVIDER']}")
    return (f"scripted model server on http://127.0.0.1:{model_port()}/v1 "
            "(used when FAULTDESK_MODEL_PROVIDER=openai_compatible)")


def down() -> None:
    """Stop every process and the embedded servers (data in var/ stays). A ``make demo`` still
    waiting for Ctrl-C is ended too (it would otherwise stop a later stack on its way out)."""
    if DEMO_PID.exists():
        demo_pid = int(DEMO_PID.read_text().strip() or 0)
        DEMO_PID.unlink(missing_ok=True)
        if demo_pid and demo_pid != os.getpid() and _pid_alive(demo_pid):
            os.kill(demo_pid, signal.SIGTERM)
            # Wait until it has stopped: it stops the stack itself on its way out, and must not
            # do so after this command returned (under a stack started later).
            for _ in range(600):
                if not _pid_alive(demo_pid):
                    break
                time.sleep(0.1)
    _stop_supervisord()
    if "REDIS_URL" not in os.environ:
        embedded.stop_redis()
    if "DATABASE_URL" not in os.environ:
        embedded.stop_postgres()
    print("• stopped", flush=True)


def _stop_supervisord() -> None:
    """Shut supervisord down and wait until the process itself has exited: it removes its socket
    at once but stops its children (up to stopwaitsecs) before exiting, and a new one started
    earlier would find the ports still taken."""
    pidfile = RUN / "supervisord.pid"
    pid = int(pidfile.read_text().strip() or 0) if pidfile.exists() else None
    if _supervisord_running():
        _supervisorctl("shutdown")
    for _ in range(600):
        if not pid or not _pid_alive(pid):
            break
        time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status() -> None:
    print(_supervisorctl("status").stdout if _supervisord_running() else "not running")


def demo(wait: bool, tenant: str = "acme") -> None:
    """``make demo``: start everything, seed, run the main job over HTTP as ``tenant``'s demo cast
    (``acme`` files in the reference ticket service, ``initech`` in django-helpdesk) — for ``acme``
    once in Chinese first (:data:`demo_client.SYMPTOM_ZH`), then in English — and keep the web up
    until Ctrl-C unless not ``wait``. Exits 1 when the demo fails."""
    up()
    print("• seeding the demo tenants, fleet and knowledge base", flush=True)
    subprocess.run([sys.executable, "-m", "tools.seed_demo"], check=True, env=_env())  # noqa: S603
    env = _env()
    # The client checks the ticket at whichever ticket system the tenant uses: same settings.
    systems = demo_client.TicketSystems(refservice_url=env["REFSERVICE_URL"],
                                        refservice_api_key=env["REFSERVICE_API_KEY"],
                                        helpdesk_url=env["HELPDESK_URL"], helpdesk_token=env["HELPDESK_API_TOKEN"])
    base_url, credentials = f"http://127.0.0.1:{web_port()}", VAR_DIR / "demo-credentials.json"
    # The Chinese run first (a Chinese report on a device with a Chinese procedure), where the tenant
    # has one; the English run's DEMO OK line is the last line either way.
    # A real 135M model on 2 cores drafts a Chinese report in up to ~45 s, and a malformed reply is
    # re-asked (each bounded by the model timeout): each wait gets room for that.
    wait_s = 600.0 if model_server() == LLAMA else 180.0
    ok = demo_client.TENANTS[tenant].chinese_device is None or demo_client.run(
        base_url=base_url, tenant=tenant, systems=systems, credentials_path=credentials, language="zh-hans",
        timeout=wait_s)
    ok = ok and demo_client.run(base_url=base_url, tenant=tenant, systems=systems, credentials_path=credentials,
                                before_ok=lambda: _manage("replay", "--all", "--remote"), timeout=wait_s)
    if not ok:
        raise SystemExit(1)
    if not wait:
        return
    print(f"\n(web app stays up at http://127.0.0.1:{web_port()}/ — press Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    DEMO_PID.write_text(str(os.getpid()))
    stop = []

    def _stop(signum, frame):  # Ctrl-C, or SIGTERM from a supervisor / CI; also when SIGINT was ignored
        stop.append(signum)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stop:
            signal.pause()
    finally:
        DEMO_PID.unlink(missing_ok=True)
        down()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="devstack", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "demo"])
    parser.add_argument("--no-wait", action="store_true",
                        help="demo: exit after the DEMO OK line (services keep running)")
    parser.add_argument("--tenant", choices=sorted(demo_client.TENANTS), default="acme",
                        help="demo: whose request to run — acme files in the reference ticket service, "
                             "initech in django-helpdesk (default acme)")
    args = parser.parse_args(argv)
    os.chdir(BASE_DIR)
    {"up": up, "down": down, "status": status}.get(
        args.command, lambda: demo(wait=not args.no_wait, tenant=args.tenant))()


if __name__ == "__main__":
    main()
