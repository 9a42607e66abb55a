"""Shared fixtures: a tenant with a requester, an approver and an admin; a device; a small
knowledge base ingested with real embeddings; the reference ticket service on loopback; and a
driver that runs the agent, tools and outbox steps in-process (no broker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from apps.accounts.models import AccessScope, Role
from apps.accounts.principal import principal_for_user
from tests.factories import DeviceFactory, MembershipFactory, TenantFactory, UserFactory

# Property-test profiles: CI runs at least 1,000 examples per property, `make proptest`
# at least 10,000; HYPOTHESIS_PROFILE=dev is quicker for local iteration.
hypothesis_settings.register_profile("ci", max_examples=1000, deadline=None)
hypothesis_settings.register_profile("proptest", max_examples=10000, deadline=None)
hypothesis_settings.register_profile("dev", max_examples=100, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

KB = Path(__file__).resolve().parent.parent / "apps" / "evidence" / "kb"
SMALL_KB = [
    ("tier2", "laser-printer-fuser-error-replacement.md"),
    ("public", "laser-printer-paper-jam.md"),
    ("public", "mfp-toner-and-drum-replacement.md"),
    ("public", "ups-on-battery-and-battery-alarms.md"),
    ("security", "badge-reader-offline-and-tamper.md"),
]


@pytest.fixture(scope="session", autouse=True)
def _catalogues_compiled():
    """The translation catalogues as the install step compiles them (``python -m tools.i18n
    compile``), so that ``pytest`` alone tests the Chinese pages with the current ``.po``."""
    from tools.i18n import compile_catalogues

    compile_catalogues()


@pytest.fixture(scope="session", autouse=True)
def _embed_each_text_once():
    """Ingestion in this test process embeds each distinct text with the real model once and
    reuses its vector after that: most tests ingest the same five knowledge-base documents, and
    re-embedding them cost about 2 s per test. The vectors are the model's own (embedding is
    deterministic for an input on one machine); only the repeated computation is skipped. Tests
    that count embedding calls patch ``services.embed_texts`` themselves, on top of this."""
    from apps.evidence import services

    real = services.embed_texts
    vectors: dict[str, list[float]] = {}

    def embed_texts(texts: list[str]) -> list[list[float]]:
        missing = [t for t in dict.fromkeys(texts) if t not in vectors]
        vectors.update(zip(missing, real(missing), strict=True))
        return [list(vectors[t]) for t in texts]

    mp = pytest.MonkeyPatch()
    mp.setattr(services, "embed_texts", embed_texts)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    """pytest-django's test database, and at its end the tool gateway's own connection closed
    first (it records each outbound call on a connection of its own, which would keep the test
    database from being dropped)."""
    yield
    from apps.gateway import records

    records.close()


@pytest.fixture(autouse=True)
def forget_outbound_calls(request):
    """Before a test that uses the database, the tool gateway's call records earlier tests left are
    deleted (tests.gateway.forget_calls: they are written outside each test's transaction). Named
    without a leading underscore so that ``from tests.conftest import *`` brings it to the apps' tests."""
    if request.node.get_closest_marker("django_db") or {"db", "transactional_db"} & set(request.fixturenames):
        from tests.gateway import forget_calls

        forget_calls()


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test starts with an empty cache: the API's throttle history (per user, per address)
    is kept there, and one test's requests must not count against the next."""
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture
def tenant(db):
    return TenantFactory(slug="acme", name="ACME")


@pytest.fixture
def requester(tenant):
    return MembershipFactory(user=UserFactory(username="riley"), tenant=tenant, role=Role.REQUESTER,
                             scopes=[AccessScope.PUBLIC, AccessScope.TIER2]).user


@pytest.fixture
def approver(tenant):
    return MembershipFactory(user=UserFactory(username="avery"), tenant=tenant, role=Role.APPROVER,
                             scopes=list(AccessScope.values)).user


@pytest.fixture
def admin_user(tenant):
    """Tenant ``acme``'s admin: staff in the tenant-admin group through her admin membership."""
    user = UserFactory(username="adele")
    MembershipFactory(user=user, tenant=tenant, role=Role.ADMIN, scopes=list(AccessScope.values))
    return user


@pytest.fixture
def other_tenant_user(db):
    other = TenantFactory(slug="globex")
    return MembershipFactory(user=UserFactory(username="gus"), tenant=other, role=Role.ADMIN,
                             scopes=list(AccessScope.values)).user


@pytest.fixture
def device(tenant):
    return DeviceFactory(tenant=tenant, asset_tag="PRN-0417")


def p(user):
    """The principal of ``user``."""
    return principal_for_user(user)


@pytest.fixture
def kb(tenant):
    """Five documents of the project's knowledge base in three scopes, really embedded."""
    from apps.evidence.services import document_ingest

    for scope, name in SMALL_KB:
        document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB / scope / name).read_text(), scope=scope)


@pytest.fixture(scope="module")
def whole_kb_tenant_shared(django_db_setup, django_db_blocker):
    """The project's whole knowledge base (every scope, English and Chinese, 525 chunks) ingested
    once per test module for a tenant of its own, committed, with the planner's statistics
    refreshed; deleted (with its documents, chunks and term statistics) when the module is done.
    Ingesting it took about 7 s, which every test that read it paid again. Only tests that read
    it inside their own rolled-back transaction (``db``) may use it: a transactional test's flush
    would delete it under the module's next tests."""
    from django.db import connection

    from apps.accounts.models import Tenant
    from apps.evidence.services import path_ingest

    with django_db_blocker.unblock():
        Tenant.objects.filter(slug="whole-kb").delete()  # left by a run killed inside a module
        tenant = TenantFactory(slug="whole-kb", name="Whole knowledge base")
        for scope in AccessScope.values:
            path_ingest(tenant=tenant, path=KB / scope, scope=scope)
        with connection.cursor() as cur:
            cur.execute("ANALYZE evidence_chunk, evidence_documentversion, evidence_document")
    yield tenant
    with django_db_blocker.unblock():
        Tenant.objects.filter(pk=tenant.pk).delete()


@pytest.fixture
def whole_kb(request, whole_kb_tenant_shared, db):
    """The tenant holding the whole knowledge base (:func:`whole_kb_tenant_shared`), for a test running in
    its own rolled-back transaction. A freshly created test database says the evidence tables are
    empty, and its nested-loop plans made each chunk lookup cost half a second once hundreds of
    chunks were in: the shared ingest refreshes the planner's statistics."""
    if "transactional_db" in request.fixturenames or any(
            m.kwargs.get("transaction") for m in request.node.iter_markers("django_db")):
        pytest.fail("whole_kb is shared by the module's tests: a transactional test would flush it")
    return whole_kb_tenant_shared


@pytest.fixture
def refservice(tmp_path, settings):
    """The reference ticket service as a real HTTP server on loopback, wired into settings."""
    from tools.refservice import serve_in_thread

    server = serve_in_thread("127.0.0.1", 0, str(tmp_path / "tickets.sqlite3"), api_key="test-key")
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_URL": server.url, "REFSERVICE_API_KEY": "test-key",
                          "REFSERVICE_TIMEOUT_SECONDS": 2.0}
    yield server
    server.shutdown()


@pytest.fixture
def model_server(settings):
    """The scripted model server as a real HTTP server on loopback, with new tasks pinned to the
    ``openai_compatible`` provider pointing at it. ``model_server.set_script([...])`` scripts it."""
    from tools.scripted_model_server import serve_in_thread

    server = serve_in_thread("127.0.0.1", 0, api_key="test-model-key")
    settings.FAULTDESK = {**settings.FAULTDESK, "MODEL_PROVIDER": "openai_compatible", "MODEL_BASE_URL": server.url,
                          "MODEL_API_KEY": "test-model-key", "MODEL_NAME": "scripted-model",
                          "MODEL_TIMEOUT_SECONDS": 5.0, "CANCEL_POLL_SECONDS": 0.05}
    yield server
    server.shutdown()


class RefAdmin:
    """Test-side client of the reference service's admin endpoints."""

    def __init__(self, server):
        import httpx

        self.client = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer test-key"}, timeout=5)

    def effects(self, key: str) -> int:
        return self.client.get("/_admin/effects", params={"idempotency_key": key}).json()["effects"]

    def requests(self, key: str) -> int:
        """``POST /tickets`` requests the service received with ``key`` (answered or not)."""
        return self.client.get("/_admin/effects", params={"idempotency_key": key}).json()["requests"]

    def tickets(self) -> list[dict]:
        body = self.client.get("/_admin/tickets").json()
        return body["results"]

    def fault(self, mode: str, count: int = 1, delay_seconds: float = 0.0) -> None:
        self.client.post("/_admin/faults", json={"mode": mode, "count": count, "delay_seconds": delay_seconds})


@pytest.fixture
def refadmin(refservice):
    return RefAdmin(refservice)


@pytest.fixture
def committed(requester, approver, device, kb, refservice):
    """A task whose approved ``ticket.create`` is committed with its outbox row (PENDING), and
    nothing sent yet: the starting point of the dispatcher and reconciliation tests."""
    from apps.agent.runner import agent_run
    from apps.approvals.models import ApprovalRequest, ApprovalStatus
    from apps.approvals.services import approval_decide
    from apps.outbox.models import OutboxMessage, OutboxStatus
    from apps.tasks.models import Task
    from apps.tasks.services import task_submit

    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                       symptom="Fuser error after warm-up, pages come out smeared with unfused toner.").task
    task = drive(task.pk)
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    assert OutboxMessage.objects.get(action__task=task).status == OutboxStatus.PENDING
    return Task.objects.get(pk=task.pk)


def created_then_cancelled(task_id, *, canceller, refadmin, reason: str = "fixed itself"):
    """Cancelled, then a receipt arrives (table 16.5), for a task whose ticket intent is committed
    at the reference service: the ticket is created but its answer is lost (the outcome is
    unknown), ``canceller`` (a user) cancels, and the reconciler then finds the ticket by its key
    and records the receipt on the cancelled task. (A receipt recorded first completes the task in
    the same commit: a cancel can no longer come between the receipt and the answer.) Returns the
    task after :func:`drive`."""
    from apps.actions.models import Action, ActionStatus
    from apps.outbox.dispatch import outbox_dispatch_batch
    from apps.tasks.services import task_cancel

    refadmin.fault("drop_after_commit")
    outbox_dispatch_batch()
    assert Action.objects.get(task_id=task_id, compensates__isnull=True).status == ActionStatus.UNKNOWN
    task_cancel(principal=p(canceller), task_id=task_id, reason=reason)
    task = drive(task_id)
    assert task.state["receipt"] is not None, "the reconciler found the ticket and recorded its receipt"
    return task


def settle_receipts() -> int:
    """The agent worker's half of the dispatcher's batched receipts, in-process: what the
    ``settle_receipts`` message the dispatcher's commit sends asks for
    (:func:`apps.outbox.receipts.receipts_settle`), for every task whose action's row holds a
    receipt the task has not recorded. Returns how many tasks recorded one."""
    from apps.actions.models import Action, ActionStatus
    from apps.outbox.receipts import receipts_settle

    ids = Action.objects.filter(status=ActionStatus.SUCCEEDED, compensates__isnull=True,
                                task__state__receipt=None).values_list("task_id", flat=True)
    return receipts_settle(list(ids))


@pytest.fixture
def plans_reducer(monkeypatch):
    """New tasks of the test are pinned to ``reducer/6`` (plan versions, the reads as parallel
    activities) whatever the default version (``reducer/6`` too, since it became ``CURRENT``)."""
    from apps.tasks import reducer

    monkeypatch.setattr(reducer, "CURRENT", reducer.v6.VERSION)


@pytest.fixture
def reads_as_activities(settings):
    """All three context reads of ``reducer/6`` are dispatched as activities of their own (by
    default only the open-ticket read is; the dispatching run does the device read and retrieval
    itself): for the tests that interleave a read's report with another read or a change."""
    settings.FAULTDESK = {**settings.FAULTDESK, "READS_AS_ACTIVITIES": ("device", "ticket", "retrieval")}


def reads_run(task_id, *, steps=None) -> list[str]:
    """Run in-process, one after the other, the read activities of the task (``reducer/6``) that are
    dispatched and have not reported — only those of ``steps`` (``"device"``, ``"ticket"``,
    ``"retrieval"``) when given. Returns the activity ids run."""
    from apps.agent.runner import read_activity_run
    from apps.tasks.models import Task

    state = Task.objects.get(pk=task_id).state or {}
    ran = []
    for aid, act in (state.get("activities") or {}).items():
        if act["status"] == "dispatched" and (steps is None or act["step"] in steps):
            read_activity_run(task_id=task_id, activity_id=aid)
            ran.append(aid)
    return ran


def drive(task_id, *, rounds: int = 30):
    """Run agent, tools, outbox and reconciler steps in-process until the task stops moving.
    Returns the task as it then stands."""
    from apps.agent.runner import agent_run, context_read
    from apps.outbox.dispatch import outbox_dispatch_batch
    from apps.outbox.unknown_outcomes import actions_reconcile
    from apps.tasks.models import Task

    last = None
    for _ in range(rounds):
        agent_run(task_id=task_id)
        context_read(task_id=task_id)
        reads_run(task_id)
        outbox_dispatch_batch()
        settle_receipts()
        actions_reconcile()
        task = Task.objects.get(pk=task_id)
        if task.version == last:
            return task
        last = task.version
    return Task.objects.get(pk=task_id)


@pytest.fixture(autouse=True)
def _replay_every_task(request):
    """After every test that used the database, replay each task it created and fail on any
    divergence from the materialized row, or any action row that disagrees with the replayed
    state (DESIGN.md §12 invariant 7), or any decision its own bundle would now take otherwise
    when re-driven (trajectory replay; ``FAULTDESK_TRAJECTORY_CHECK=0`` skips that part). Tests that
    tamper with a row on purpose are marked ``allow_divergence``."""
    marker = request.node.get_closest_marker("django_db")
    names = request.fixturenames
    if "transactional_db" in names or (marker and marker.kwargs.get("transaction")):
        request.getfixturevalue("transactional_db")
    elif "db" in names or marker:
        request.getfixturevalue("db")
    else:
        yield
        return
    yield
    if request.node.get_closest_marker("allow_divergence"):
        return
    from apps.actions.audit import task_actions_audit
    from apps.tasks.models import Task
    from apps.tasks.replay import task_replay

    tasks = list(Task.objects.all())
    diverged = [r for r in (task_replay(t) for t in tasks) if not r.ok]
    assert not diverged, f"tasks diverge from their event log: {diverged}"
    disagreeing = {str(t.pk): problems for t in tasks if (problems := task_actions_audit(t))}
    assert not disagreeing, f"action rows disagree with the task state: {disagreeing}"
    if os.environ.get("FAULTDESK_TRAJECTORY_CHECK", "1") != "0" and not request.node.get_closest_marker(
            "no_trajectory_check"):
        _trajectories_same(tasks)


def _trajectories_same(tasks) -> None:
    """Trajectory replay of every task under its own pinned bundle (apps/agent/trajectories.py):
    the recorded model replies re-driven through the same controller must reach the same tool,
    target, priority and termination at every decision point. (Approval need is left out: tests
    change a tenant's policy between a task's decisions on purpose.)"""
    from apps.agent.trajectories import trajectory_replay

    diverged, unreplayable = {}, {}
    for task in tasks:
        replay = trajectory_replay(task, {})
        if replay.unreplayable or replay.unreplayable_points:
            unreplayable[str(task.pk)] = replay.unreplayable or [p.unreplayable for p in replay.unreplayable_points]
        for point in replay.points:
            fields = [d for d in point.divergences if d[0] != "approval_need"]
            if fields:
                diverged.setdefault(str(task.pk), []).append((point.seq, fields))
    assert not diverged, f"re-driven through their own bundle, tasks decide otherwise: {diverged}"
    assert not unreplayable, f"tasks the release gate could not re-drive through their own bundle: {unreplayable}"


@pytest.fixture
def json_lines():
    """Every log record of the test rendered by the production formatter (``config.logs``) into a
    buffer; calling the fixture's value returns the lines parsed as JSON."""
    import io
    import json
    import logging
    import logging.config

    from config.logs import clear, logging_config

    buffer = io.StringIO()
    config = logging_config(fmt="json")
    formatter = logging.config.DictConfigurator(config).configure_formatter(config["formatters"]["structured"])
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    clear()
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]
    root.removeHandler(handler)
    clear()


@pytest.fixture(scope="session")
def real_model_server(tmp_path_factory):
    """The base URL (``http://127.0.0.1:<port>/v1``) of the real local model server — llama.cpp with
    SmolLM2-135M-Instruct, one for the session (tests/model_server.py). Skips when ``make model`` has
    not run, and fails instead under ``make test-model`` (``FAULTDESK_REQUIRE_MODEL=1``). The tool
    gateway may reach it for the session (``FAULTDESK_GATEWAY_ALLOW_MODEL``)."""
    from django.conf import settings

    from tests.gateway import destinations_allowed
    from tests.model_server import running_model_server

    with running_model_server(tmp_path_factory.mktemp("model-server"),
                              api_key=settings.FAULTDESK["MODEL_API_KEY"]) as base_url, \
            destinations_allowed("model", base_url):
        yield base_url
