"""End to end with real processes (issue 2 acceptance): web (gunicorn), a Celery worker on the
``agent``, ``tools`` and ``outbox`` queues, Celery beat and the reference ticket service, all
against the test database and a real Redis broker. The test acts only through HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from django.contrib.auth.hashers import make_password
from django.db import connection

from apps.accounts.models import AccessScope, Role
from apps.events.replay import task_replay
from apps.evidence.models import Chunk
from apps.tasks.models import Task
from config import embedded
from tests.conftest import KB, SMALL_KB
from tests.factories import DeviceFactory, MembershipFactory, TenantFactory, UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parent.parent
BROKER_DB = 9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, timeout: float, procs: dict) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def _database_url() -> str:
    s = connection.settings_dict
    opts = s.get("OPTIONS") or {}
    host = s.get("HOST") or opts.get("host") or ""
    port = s.get("PORT") or opts.get("port") or 5432
    user = s.get("USER") or "postgres"
    password = s.get("PASSWORD") or ""
    if host.startswith("/"):
        return f"postgres://{user}:{password}@/{s['NAME']}?host={host}&port={port}"
    return f"postgres://{user}:{password}@{host}:{port}/{s['NAME']}"


def _broker_url() -> str:
    if os.environ.get("REDIS_URL"):
        base = os.environ["REDIS_URL"]
        return base.rsplit("/", 1)[0] + f"/{BROKER_DB}" if base.startswith("redis://") else base
    embedded.ensure_redis()
    return embedded.redis_url(BROKER_DB)


def _flush_broker(url: str) -> None:
    import redis

    if url.startswith("redis+socket://"):
        redis.Redis(unix_socket_path=str(embedded.REDIS_SOCKET), db=BROKER_DB).flushdb()
    else:
        redis.Redis.from_url(url).flushdb()


@pytest.fixture
def stack(transactional_db, tmp_path):
    """Start web, worker, beat and the reference ticket service; yield their URLs."""
    web_port, ref_port = _free_port(), _free_port()
    broker = _broker_url()
    _flush_broker(broker)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.local",
        "DJANGO_DEBUG": "false",
        "DATABASE_URL": _database_url(),
        "REDIS_URL": broker,
        "REFSERVICE_URL": f"http://127.0.0.1:{ref_port}",
        "REFSERVICE_API_KEY": "e2e-key",
        "FAULTDESK_PUBLIC_BASE_URL": f"http://127.0.0.1:{web_port}",
        "PYTHONUNBUFFERED": "1",
    }
    bin_dir = Path(sys.executable).parent
    commands = {
        "refservice": [sys.executable, "-m", "apps.tickets.refservice", "--host", "127.0.0.1", "--port", str(ref_port),
                       "--db", str(tmp_path / "tickets.sqlite3"), "--api-key", "e2e-key"],
        "web": [str(bin_dir / "gunicorn"), "config.wsgi", "-b", f"127.0.0.1:{web_port}", "-w", "2", "--threads", "2"],
        "worker": [str(bin_dir / "celery"), "-A", "config", "worker", "-Q", "agent,tools,outbox", "-c", "2",
                   "-n", f"e2e-{web_port}@%h", "--loglevel", "INFO"],
        "beat": [str(bin_dir / "celery"), "-A", "config", "beat", "-s", str(tmp_path / "beat-schedule"),
                 "--loglevel", "INFO"],
    }
    procs, logs = {}, {}
    for name, cmd in commands.items():
        logs[name] = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[name], stderr=subprocess.STDOUT,  # noqa: S603
                                       start_new_session=True)
    try:
        _wait(f"http://127.0.0.1:{ref_port}/healthz", 30, procs)
        _wait(f"http://127.0.0.1:{web_port}/healthz", 60, procs)
        yield {"web": f"http://127.0.0.1:{web_port}", "ref": f"http://127.0.0.1:{ref_port}", "procs": procs,
               "logs": tmp_path}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in logs.values():
            f.close()
        _flush_broker(broker)


def _seed():
    from apps.evidence.services import document_ingest

    tenant = TenantFactory(slug="acme", name="ACME")
    requester = MembershipFactory(user=UserFactory(username="riley"), tenant=tenant, role=Role.REQUESTER,
                                  scopes=[AccessScope.PUBLIC, AccessScope.TIER2]).user
    approver = MembershipFactory(user=UserFactory(username="avery"), tenant=tenant, role=Role.APPROVER,
                                 scopes=list(AccessScope.values)).user
    for user in (requester, approver):  # the server processes hash with PBKDF2
        user.password = make_password("pw-for-tests", hasher="pbkdf2_sha256")
        user.save(update_fields=["password"])
    device = DeviceFactory(tenant=tenant, asset_tag="PRN-0417")
    for scope, name in SMALL_KB:
        document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB / scope / name).read_text(), scope=scope)
    return tenant, requester, device


def _poll(client, task_id, statuses, timeout, stack):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = client.get(f"/api/tasks/{task_id}/").raise_for_status().json()
        if body["status"] in statuses:
            return body
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in Path(stack["logs"]).glob("*.log"))
    raise AssertionError(f"task stuck in {body['status']}\n{logs}")


def test_main_job_end_to_end_with_real_processes(stack):
    tenant, requester, device = _seed()
    riley = httpx.Client(base_url=stack["web"], auth=("riley", "pw-for-tests"), timeout=30)
    avery = httpx.Client(base_url=stack["web"], auth=("avery", "pw-for-tests"), timeout=30)
    body = {"device_id": device.pk, "symptom": "Fuser error after warm-up; pages smeared.", "urgency": "high"}

    created = riley.post("/api/tasks/", json=body, headers={"Idempotency-Key": "e2e-1"})
    assert created.status_code == 201, created.text
    task_id = created.json()["id"]
    assert riley.post("/api/tasks/", json=body, headers={"Idempotency-Key": "e2e-1"}).json()["id"] == task_id

    waiting = _poll(riley, task_id, {"WAITING_APPROVAL"}, 120, stack)
    assert waiting["receipt"] is None
    approvals = avery.get("/api/approvals/", params={"status": "PENDING", "task": task_id}).json()
    assert len(approvals) == 1
    decided = avery.post(f"/api/approvals/{approvals[0]['id']}/decision/", json={"decision": "approve"})
    assert decided.status_code == 200, decided.text

    done = _poll(riley, task_id, {"COMPLETED", "FAILED", "CANCELLED"}, 120, stack)
    assert done["status"] == "COMPLETED"
    ticket_id = done["receipt"]["external_id"]
    assert done["answer"]["change"]["ticket_id"] == ticket_id

    task = Task.objects.get(pk=task_id)
    key = task.state["action"]["idempotency_key"]
    ref = httpx.Client(base_url=stack["ref"], headers={"Authorization": "Bearer e2e-key"}, timeout=10)
    held = ref.get("/tickets", params={"idempotency_key": key}).json()["results"]
    assert [t["id"] for t in held] == [ticket_id]
    assert ref.get("/_admin/effects", params={"idempotency_key": key}).json()["effects"] == 1
    assert len(ref.get("/_admin/tickets").json()["results"]) == 1

    refs = task.state["evidence"]
    assert refs
    for r in refs:
        chunk = Chunk.objects.select_related("document_version").get(pk=r["chunk_id"])
        assert chunk.scope in ("public", "tier2") and chunk.tenant_id == tenant.pk
        assert chunk.document_version.version == r["version"]

    result = task_replay(task)
    assert result.ok, result.detail
    assert result.events == task.version or result.from_snapshot
