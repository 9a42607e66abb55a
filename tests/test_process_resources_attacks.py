"""Adversarial tests of the per-process resources the bench's profile led to (docs/performance.md):
one torch thread per query embedding, one TLS context per process, persistent database connections —
and the bench's own instruments."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import ssl
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from django.db import close_old_connections, connection, transaction

from apps.core import tool_errors as errors
from apps.evidence import embedding
from apps.tickets.connectors import HelpdeskConnector, ReferenceTicketConnector
from config.tls import _context_for, tls_context
from tools.bench.harness import WalCommits

ROOT = Path(__file__).resolve().parents[1]
SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
QUERIES = [
    "fuser error after warm-up, smeared pages",
    "paper jam in tray 2",
    "UPS on battery alarm beeping",
    "badge reader offline tamper",
    "toner low replace drum",
]


# --- 1. embed_query on its own torch thread count ---------------------------------------------------
# (the torch-backed model, all-MiniLM-L6-v2; the default use-multilingual-v3 is numpy on one thread)


@pytest.fixture(autouse=True)
def _torch_backed_embedding(settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "EMBEDDING_MODEL": embedding.MINILM_MODEL}

@pytest.fixture
def torch_default():
    import torch

    default = torch.get_num_threads()
    yield default
    torch.set_num_threads(default)


def _run_in_thread(fn, timeout=120):
    """``fn()`` in a fresh thread; its result, or the exception it raised. Fails on a hang."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"no answer within {timeout} s (deadlock?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_thread_that_first_uses_torch_during_a_query_keeps_torchs_default(torch_default, monkeypatch):
    """torch.set_num_threads is not one process-wide knob: the OpenMP count is per thread, and the
    global value is what a thread takes on its first torch call. A thread that touches torch while
    embed_query holds 1 (a gunicorn thread ingesting, a pool thread of the floor) keeps 1 for good."""
    import torch

    if torch_default < 2:
        pytest.skip("torch's default is already one thread here")
    original = embedding.embed_texts
    inside, release, seen = threading.Event(), threading.Event(), {}

    def newcomer():
        seen["during"] = torch.get_num_threads()  # this thread's first torch call
        inside.set()
        release.wait(60)
        seen["after"] = torch.get_num_threads()  # what its own later batch would run on

    def texts_with_a_newcomer(texts, **kw):
        threading.Thread(target=newcomer, daemon=True, name="newcomer").start()
        assert inside.wait(60)
        return original(texts, **kw)

    monkeypatch.setattr(embedding, "embed_texts", texts_with_a_newcomer)
    embedding.embed_query("paper jam in tray 2")
    release.set()
    for _ in range(600):
        if "after" in seen:
            break
        threading.Event().wait(0.05)
    assert torch.get_num_threads() == torch_default  # the querying thread got its count back
    assert seen["after"] == torch_default, (
        f"a thread that first used torch during a query runs on {seen['after']} thread(s) for good "
        f"(torch's default here: {torch_default})")


@pytest.mark.parametrize("configured, expected", [(0, "default"), (-2, "default"), (1, 1), (3, 3)])
def test_query_threads_setting_is_applied_during_the_call_and_undone_after(
        settings, monkeypatch, torch_default, configured, expected):
    import torch

    settings.FAULTDESK = {**settings.FAULTDESK, "EMBEDDING_QUERY_THREADS": configured}
    original, seen = embedding.embed_texts, []

    def spy(texts, **kw):
        seen.append(torch.get_num_threads())
        return original(texts, **kw)

    monkeypatch.setattr(embedding, "embed_texts", spy)
    vec = embedding.embed_query("paper jam in tray 2")
    assert len(vec) == embedding.DIMENSIONS
    assert seen == [torch_default if expected == "default" else expected]
    assert torch.get_num_threads() == torch_default


def test_a_failing_query_embedding_restores_the_thread_count_and_releases_the_lock(
        monkeypatch, torch_default):
    import torch

    def boom(texts, **kw):
        raise RuntimeError("model exploded")

    embedding._load()
    monkeypatch.setattr(embedding, "embed_texts", boom)
    with pytest.raises(RuntimeError):
        embedding.embed_query("paper jam")
    assert torch.get_num_threads() == torch_default
    monkeypatch.undo()
    # the lock was released: the next query (in another thread) does not hang
    assert len(_run_in_thread(lambda: embedding.embed_query("paper jam"), timeout=60)) == embedding.DIMENSIONS


def test_queries_and_a_batch_in_concurrent_threads_neither_deadlock_nor_change_results(torch_default):
    """gunicorn threads / the floor's pool: embed_query in several threads while embed_texts (an
    ingest batch) runs in another; the tokenizer and the model are shared."""
    import torch

    batch = [f"{q} — variant {i}" for i in range(8) for q in QUERIES]
    alone_q = {q: embedding.embed_query(q) for q in QUERIES}
    alone_b = embedding.embed_texts(batch)
    results, failures = {}, []
    start = threading.Barrier(len(QUERIES) + 2)

    def query(q):
        try:
            start.wait(30)
            for _ in range(3):
                results.setdefault(q, []).append(embedding.embed_query(q))
        except BaseException as exc:  # noqa: BLE001
            failures.append(repr(exc))

    def ingest(tag):
        try:
            start.wait(30)
            results[tag] = embedding.embed_texts(batch)
        except BaseException as exc:  # noqa: BLE001
            failures.append(repr(exc))

    threads = [threading.Thread(target=query, args=(q,), daemon=True) for q in QUERIES]
    threads += [threading.Thread(target=ingest, args=(f"batch{i}",), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "deadlock: threads still running after 180 s"
    assert not failures, failures
    worst = max(abs(a - b) for q in QUERIES for v in results[q] for a, b in zip(v, alone_q[q], strict=True))
    worst = max([worst] + [abs(a - b) for tag in ("batch0", "batch1")
                           for v, w in zip(results[tag], alone_b, strict=True) for a, b in zip(v, w, strict=True)])
    assert worst < 1e-5, worst
    assert torch.get_num_threads() == torch_default


def test_query_embedding_agrees_with_the_batch_embedding_and_rankings_do_not_move(settings, kb, tenant):
    from apps.evidence.selectors import evidence_retrieve

    for q in QUERIES:
        one = embedding.embed_query(q)
        batch = embedding.embed_texts([q])[0]
        assert max(abs(a - b) for a, b in zip(one, batch, strict=True)) < 1e-5

    def ranking(threads):
        settings.FAULTDESK = {**settings.FAULTDESK, "EMBEDDING_QUERY_THREADS": threads}
        return [[(r.chunk_id, r.vector_rank, r.text_rank)
                 for r in evidence_retrieve(tenant_id=tenant.pk, scopes=["public", "tier2", "security"], query=q, k=8)]
                for q in QUERIES]

    assert ranking(1) == ranking(0)


# --- 2. one TLS context per process -----------------------------------------------------------------

def _cert(directory: Path, name: str, san: str) -> tuple[str, str]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",  # noqa: S603,S607
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName={san}", "-addext", "basicConstraints=critical,CA:TRUE"],
                   check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    return SimpleNamespace(good=_cert(d, "good", "IP:127.0.0.1,DNS:localhost"),
                           other=_cert(d, "other", "IP:127.0.0.1,DNS:localhost"),
                           wrong_host=_cert(d, "wronghost", "DNS:example.invalid"))


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        return

    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._json({"results": []})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._json({"results": []})


class _TLSServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, cert):
        super().__init__(("127.0.0.1", 0), _Answer)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(*cert)

    def finish_request(self, request, client_address):
        try:
            tls = self.ctx.wrap_socket(request, server_side=True)
        except OSError:  # the client refused our certificate
            return
        self.RequestHandlerClass(tls, client_address, self)

    def handle_error(self, request, client_address):
        return

    @property
    def url(self):
        return f"https://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def https(certs, settings):
    """``https(name)`` starts a TLS server presenting certificate ``name`` of :func:`certs`, which
    the tool gateway lets the connectors and the model provider reach."""
    from tests.gateway import allow

    servers = []

    def start(name):
        server = _TLSServer(getattr(certs, name))
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        for tool in ("ticket.reference", "ticket.helpdesk", "model"):
            allow(settings, tool, server.url)
        return server

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture
def fresh_tls():
    """The shared context rebuilt from the environment the test sets; rebuilt again afterwards."""
    _context_for.cache_clear()
    yield
    _context_for.cache_clear()


def _lookup(url):
    return ReferenceTicketConnector(base_url=url, timeout=5).lookup_by_key(idempotency_key="k-1")


def test_connectors_and_provider_still_reject_a_self_signed_certificate(https, fresh_tls):
    from apps.llm.providers import OpenAICompatibleProvider

    server = https("good")
    tls_context()  # the cached context, as after the process's first call
    with pytest.raises(errors.DefinitelyNotExecuted, match="CERTIFICATE_VERIFY_FAILED"):
        _lookup(server.url)
    helpdesk = HelpdeskConnector(base_url=server.url, timeout=5)
    with pytest.raises(errors.DefinitelyNotExecuted, match="CERTIFICATE_VERIFY_FAILED"):
        helpdesk._send("GET", "/api/tickets/", what="list")
    provider = OpenAICompatibleProvider(base_url=server.url + "/v1", model="m",
                                        max_output_tokens=100, units_per_1k=1.0)
    result = provider.complete([{"role": "user", "content": "hi"}], timeout=5)
    assert result.outcome == "unavailable" and "CERTIFICATE_VERIFY_FAILED" in (result.error or "")
    ctx = tls_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_a_trusted_certificate_is_accepted_only_for_its_own_host(https, fresh_tls, monkeypatch, certs):
    monkeypatch.setenv("SSL_CERT_FILE", certs.good[0])
    _context_for.cache_clear()
    assert _lookup(https("good").url) is None  # trusted: the lookup answers (nothing found)
    monkeypatch.setenv("SSL_CERT_FILE", certs.wrong_host[0])
    _context_for.cache_clear()
    with pytest.raises(errors.DefinitelyNotExecuted, match="CERTIFICATE_VERIFY_FAILED|IP address mismatch|hostname"):
        _lookup(https("wrong_host").url)


def _child_lookups(good_url, bad_url, queue):
    out = {}
    try:
        out["good"] = repr(_lookup(good_url))
    except Exception as exc:  # noqa: BLE001
        out["good"] = f"error: {exc!r}"
    try:
        out["bad"] = repr(_lookup(bad_url))
    except Exception as exc:  # noqa: BLE001
        out["bad"] = f"error: {exc!r}"
    out["same_context"] = _context_for.cache_info().hits > 0
    queue.put(out)


def test_the_context_built_before_a_fork_verifies_in_the_child(https, fresh_tls, monkeypatch, certs):
    """Celery prefork: the parent may build the context, the pool processes use it."""
    monkeypatch.setenv("SSL_CERT_FILE", certs.good[0])
    _context_for.cache_clear()
    good, bad = https("good"), https("other")
    assert _lookup(good.url) is None  # built and used in the parent
    mp = multiprocessing.get_context("fork")
    queue = mp.Queue()
    child = mp.Process(target=_child_lookups, args=(good.url, bad.url, queue))
    child.start()
    out = queue.get(timeout=60)
    child.join(30)
    assert out["good"] == "None", out
    assert out["bad"].startswith("error: DefinitelyNotExecuted") and "CERTIFICATE_VERIFY_FAILED" in out["bad"], out
    assert out["same_context"], "the child built its own context instead of using the inherited one"


def test_the_shared_context_under_concurrent_clients(https, fresh_tls, monkeypatch, certs):
    monkeypatch.setenv("SSL_CERT_FILE", certs.good[0])
    _context_for.cache_clear()
    good, bad = https("good"), https("other")
    outcomes, lock = [], threading.Lock()
    start = threading.Barrier(12)

    def client(i):
        start.wait(30)
        for _ in range(5):
            url = bad.url if i % 4 == 0 else good.url
            try:
                got = ("ok", _lookup(url))
            except errors.DefinitelyNotExecuted as exc:
                got = ("refused", "CERTIFICATE_VERIFY_FAILED" in str(exc))
            except Exception as exc:  # noqa: BLE001
                got = ("other", repr(exc))
            with lock:
                outcomes.append((url == bad.url, got))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 60
    assert all(got == ("refused", True) for is_bad, got in outcomes if is_bad), outcomes
    assert all(got == ("ok", None) for is_bad, got in outcomes if not is_bad), outcomes


def test_a_changed_ssl_cert_file_is_honoured_like_a_new_httpx_client_would(https, fresh_tls, monkeypatch, certs):
    """config/tls.py promises what httpx.Client(verify=True) would build, SSL_CERT_FILE honoured.
    A process whose CA bundle changes (a CA dropped from it) keeps trusting the old bundle."""
    server = https("good")
    monkeypatch.setenv("SSL_CERT_FILE", certs.good[0])
    assert _lookup(server.url) is None  # the context is built with the bundle trusting "good"
    monkeypatch.setenv("SSL_CERT_FILE", certs.other[0])  # the bundle no longer trusts it
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.Client().get(server.url)  # what a new client verifies against
    with pytest.raises(errors.DefinitelyNotExecuted, match="CERTIFICATE_VERIFY_FAILED"):
        _lookup(server.url)


# --- 3. persistent database connections -------------------------------------------------------------

def _settings_in_subprocess(module: str, extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_", "DJANGO_"))}
    env.update({"DJANGO_SETTINGS_MODULE": module, "DATABASE_URL": "postgres://u:p@db.invalid:5432/fd",
                "REDIS_URL": "redis://redis.invalid:6379/0", "DJANGO_SECRET_KEY": "x" * 50, **extra_env})
    code = ("import json; from django.conf import settings; d = settings.DATABASES['default']; "
            "print(json.dumps({'age': d.get('CONN_MAX_AGE'), 'checks': d.get('CONN_HEALTH_CHECKS')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: S603
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_production_settings_keep_persistent_health_checked_connections():
    """README: DATABASE_CONN_MAX_AGE (default 60, checked before reuse). production.py replaces
    DATABASES wholesale, so production gets neither the default nor the variable."""
    local = _settings_in_subprocess("config.settings.local", {})
    assert local == {"age": 60, "checks": True}
    prod = _settings_in_subprocess("config.settings.production", {})
    assert prod == {"age": 60, "checks": True}, f"production: {prod}"
    assert _settings_in_subprocess("config.settings.production", {"DATABASE_CONN_MAX_AGE": "5"})["age"] == 5


@pytest.fixture
def persistent_connection():
    """Django's connection configured as local/production settings configure it (60 s, checked)."""
    saved = {k: connection.settings_dict.get(k) for k in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS")}
    connection.close()
    connection.settings_dict.update(CONN_MAX_AGE=60, CONN_HEALTH_CHECKS=True)
    yield connection
    connection.close()
    connection.settings_dict.update(saved)


def _backend_pid():
    with connection.cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        return cur.fetchone()[0]


def _kill(pid):
    import psycopg

    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.django_db(transaction=True)
def test_celery_tasks_reuse_the_persistent_connection(persistent_connection):
    """The commit's claim: each Celery task no longer opens its own PostgreSQL backend. Two tasks
    in a row through Celery's Django fixup (what a worker process runs around every task)."""
    from celery.fixups.django import DjangoWorkerFixup

    from config.celery import app

    fixup = DjangoWorkerFixup(app)
    sender = SimpleNamespace(request=SimpleNamespace(is_eager=False))
    pids = []
    for _ in range(2):
        fixup.on_task_prerun(sender=sender)
        pids.append(_backend_pid())
        fixup.on_task_postrun(sender=sender)
    assert pids[0] == pids[1], f"each task opened its own backend: {pids}"


@pytest.mark.django_db(transaction=True)
def test_a_dead_persistent_connection_is_replaced_at_the_next_request(persistent_connection):
    """A PostgreSQL restart (or a killed backend) between two requests: the health check at the
    next request replaces the connection instead of failing the request."""
    from apps.accounts.models import Tenant

    close_old_connections()  # request_started
    first = _backend_pid()
    close_old_connections()  # request_finished: kept (60 s)
    _kill(first)
    close_old_connections()  # the next request_started
    assert Tenant.objects.count() >= 0
    assert _backend_pid() != first


@pytest.mark.django_db(transaction=True)
def test_a_request_that_failed_on_the_database_hands_over_a_clean_connection(persistent_connection):
    from django.db import DatabaseError

    from apps.accounts.models import Tenant

    close_old_connections()
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT 1 / 0")
    with pytest.raises(DatabaseError), connection.cursor() as cur:
        cur.execute("SELECT * FROM no_such_table")
    close_old_connections()  # request_finished
    close_old_connections()  # next request_started
    with connection.cursor() as cur:
        cur.execute("SELECT state FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        assert cur.fetchone()[0] == "active"
        assert connection.get_autocommit() and not connection.in_atomic_block
        cur.execute("SELECT now() = statement_timestamp()")  # not inside a transaction left open
        assert cur.fetchone()[0]
    assert Tenant.objects.count() >= 0


@pytest.mark.django_db(transaction=True)
def test_retrieval_leaves_no_session_state_on_a_reused_connection(persistent_connection, kb, tenant):
    from apps.evidence.selectors import evidence_retrieve

    with connection.cursor() as cur:
        cur.execute("SHOW hnsw.ef_search")
        before = cur.fetchone()[0]
    evidence_retrieve(tenant_id=tenant.pk, scopes=["public"], query="paper jam", k=5)
    with connection.cursor() as cur:
        cur.execute("SHOW hnsw.ef_search")
        assert cur.fetchone()[0] == before
        cur.execute("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'")
        assert cur.fetchone()[0] == 0


_SESSION_STATE = re.compile(
    r"""(?ix) (?:^\s*|["'(;]\s*) SET\s+(?!LOCAL\b)(?:SESSION\s+)?[a-z_.]+\s*(?:=|\bTO\b)  # a plain SET
    | pg_advisory_lock | pg_try_advisory_lock(?!_)                       # session-level advisory locks
    | \bCREATE\s+(?:GLOBAL\s+|LOCAL\s+)?TEMP(?:ORARY)?\s+TABLE           # temporary tables
    | set_config\s*\([^)]*,\s*false                                      # set_config(..., is_local=false)
    | \bLISTEN\b | \bPREPARE\s+\w+\s+AS""")


def test_no_session_level_state_in_code_that_runs_on_a_reused_connection():
    """With CONN_MAX_AGE > 0 a backend serves many requests and tasks: a plain SET, a session
    advisory lock or a temp table would leak into the next one. (SQL to SQLite and psql is not
    a Django connection.)"""
    offenders = []
    for path in [*ROOT.glob("apps/**/*.py"), *ROOT.glob("config/**/*.py"), *ROOT.glob("tools/**/*.py")]:
        rel = str(path.relative_to(ROOT))
        if "/migrations/" in rel or rel.startswith(("tools/refservice/", "config/embedded.py",
                                                     "tools/chaos/", "tools/bench/__main__.py",
                                                     "tools/bench/ceiling.py")):
            continue
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            m = _SESSION_STATE.search(line)
            if m and re.search("TEMP", m.group(0), re.I) and "ON COMMIT DROP" in " ".join(lines[n - 1:n + 2]):
                continue  # dropped at the end of its transaction
            if m:
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.django_db
def test_every_process_holding_a_persistent_connection_fits_max_connections():
    """make up plus make bench on the same embedded server, every gunicorn thread and Celery pool
    process holding its connection."""
    from tools.devstack import programs

    held = 0
    for name, cmd in programs().items():
        if name == "web":
            held += int(re.search(r" -w (\d+)", cmd).group(1)) * int(re.search(r"--threads (\d+)", cmd).group(1))
        elif name.startswith("worker"):
            held += int(re.search(r" -c (\d+)", cmd).group(1)) + 1  # pool + the node's own
        elif name == "beat":
            held += 1
    # the bench's largest phase (e2e, 4 workers): web, the worker node, beat, its psycopg and Django connections
    bench_peak = 2 * 4 + (4 + 1) + 1 + 2
    with connection.cursor() as cur:
        cur.execute("SELECT current_setting('max_connections')::int - "
                    "current_setting('superuser_reserved_connections')::int")
        limit = cur.fetchone()[0]
    # room left for a test session's own processes, psql and pgbench's 8 clients
    assert held + bench_peak + 30 <= limit, (held, bench_peak, limit)


# --- 4. the bench's instruments ---------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_commits_count_a_transaction_with_a_writing_savepoint_once():
    """docs/performance.md: commits are "one record per top-level transaction that wrote ...
    whatever savepoints it used inside". A nested atomic() that writes takes a subtransaction id of
    its own (the first counter, transaction ids, counted it twice); faultdesk's services nest
    atomic() all the time."""
    from apps.accounts.models import Tenant

    connection.ensure_connection()
    wal = WalCommits(connection.connection)
    wal.start()
    with transaction.atomic():
        Tenant.objects.create(slug="sp-outer", name="outer")
        with transaction.atomic():
            Tenant.objects.create(slug="sp-inner", name="inner")
    commits, aborts = wal.stop()
    assert (commits, aborts) == (1, 0)


class _FakeCursor:
    def __init__(self, rows):
        self.rows = rows

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def execute(self, sql, params=None):
        self.sql = sql

    def fetchall(self):
        return self.rows

    def fetchone(self):
        return self.rows[0]


class _FakeBench:
    ports = {"web": 1, "ref": 2, "noop": 3}
    env: dict = {}
    procs: dict = {}

    def __getattr__(self, name):
        return lambda *a, **k: None


def test_e2e_stops_when_not_every_task_ended(monkeypatch):
    """Four reports, two of them ended at t=10 s, two never did (a timeout): no tasks/s figure
    (it was 4 ÷ 10 s), a clear stop instead."""
    import redis

    from tools.bench import e2e

    rows = [("COMPLETED", 0.0, 9.0, 10.0), ("COMPLETED", 0.0, 9.5, 10.0),
            ("RUNNING", 0.0, None, None), ("RUNNING", 0.0, None, None)]
    monkeypatch.setattr(redis, "Redis", lambda *a, **k: SimpleNamespace(flushdb=lambda: None))
    monkeypatch.setattr(e2e, "tenant_seed", lambda *a, **k: SimpleNamespace(users={"requester": "r"},
                                                                             devices=list(range(10))))
    monkeypatch.setattr(e2e, "submit_all",
                        lambda base, user, devices, n, prefix, **k: [f"{prefix}-{i}" for i in range(n)])
    monkeypatch.setattr(e2e, "session_client", lambda base, user: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(e2e, "wait_terminal",
                        lambda conn, ids, timeout, **k: 2 if ids[0].startswith("e2e") else len(ids))
    monkeypatch.setattr(e2e, "WalCommits", lambda conn: SimpleNamespace(start=lambda: None, stop=lambda: (0, 0)))
    conn = SimpleNamespace(cursor=lambda: _FakeCursor(rows))
    with pytest.raises(SystemExit, match="only 2 of 4 tasks ended"):
        e2e.run_one(_FakeBench(), conn, workers=1, n=4)


def test_outbox_phase_stops_when_the_backlog_does_not_drain(monkeypatch):
    """outbox.run's docstring: SystemExit when the backlog ... does not drain. Half of it drained."""
    import redis

    from tools.bench import outbox

    n = 10
    clock = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(outbox, "time", SimpleNamespace(monotonic=lambda: float(next(clock)), sleep=lambda s: None))
    monkeypatch.setattr(redis, "Redis", lambda *a, **k: SimpleNamespace(flushdb=lambda: None))
    monkeypatch.setattr(outbox, "tenant_seed", lambda *a, **k: SimpleNamespace(users={"requester": "r"},
                                                                                devices=list(range(n))))
    monkeypatch.setattr(outbox, "submit_all", lambda *a, **k: [f"t{i}" for i in range(n)])
    monkeypatch.setattr(outbox, "WalCommits", lambda conn: SimpleNamespace(start=lambda: None, stop=lambda: (0, 0)))

    class Conn:
        def cursor(self):
            return Cursor()

        def close(self):
            pass

    class Cursor(_FakeCursor):
        def __init__(self):
            super().__init__(None)

        def fetchone(self):
            return (n, n // 2, n) if "FILTER" in self.sql else (0.0, 5.0)

    monkeypatch.setattr(outbox.psycopg, "connect", lambda *a, **k: Conn())
    bench = _FakeBench()
    bench.figure = lambda *a, **k: None
    with pytest.raises(SystemExit):
        outbox.run(bench, n=n)


def test_peak_rss_of_a_tree_counts_a_grandchild_larger_than_its_parent():
    """A stronger check of the harness: a small parent whose child holds 96 MiB."""
    from tools.bench.harness import rss_tree_peak_mb

    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; b = bytearray(96 * 2**20); "
            "b[::4096] = b\"x\" * len(b[::4096]); print(1, flush=True); time.sleep(30)'], stdout=subprocess.PIPE); "
            "c.stdout.readline(); print(c.pid, flush=True); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)  # noqa: S603
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        largest, total = rss_tree_peak_mb(parent.pid)
        own_parent, _ = rss_tree_peak_mb(child_pid)  # the child alone
        assert own_parent >= 96
        assert largest >= 96 and total >= largest + 5  # the child, plus the (small) parent
    finally:
        parent.kill()
        parent.wait()
        if child_pid:
            with contextlib.suppress(OSError):
                os.kill(child_pid, 9)


def test_concurrent_first_calls_build_the_context_once(fresh_tls, monkeypatch):
    built = []
    real = httpx.create_ssl_context

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "create_ssl_context", counted)
    start = threading.Barrier(8)

    def first_call(_):
        start.wait()
        return tls_context()

    with ThreadPoolExecutor(8) as pool:
        contexts = list(pool.map(first_call, range(8)))
    assert len(built) == 1
    assert all(c is contexts[0] for c in contexts)
