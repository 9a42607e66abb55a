"""Phase 6, pages: how fast two admin pages answer at a realistic size — the approver's queue with
10,000 pending approvals (``/approvals/``) and the trace of a task with 2,000 events: its first page
(``/tasks/<id>/trace/``, 100 events a page), its last page (``?page=20``) and the cost chart over
all its events that the page loads as a fragment (``/tasks/<id>/trace/budget/``) — p50/p95 over
``requests`` GETs each through gunicorn, logged in through the login form as a browser is.

Seeding (in-process, on the bench database, well under a minute):

* one real task is driven through the real pipeline in-process (agent and tools steps, the local
  drafter, a policy that requires approval for ``ticket.create``) to ``WAITING_APPROVAL``; its rows
  — the task, its events, snapshots and refused events, its approval — are then copied in bulk
  (``INSERT … SELECT``) with new task and approval ids (the approval id also inside the task's
  state and its ``approval.requested`` event, whose payload digest is recomputed), and the
  tenant's day ledger moves by what the copies reserved and used. Every copy is in the
  template's tenant, on its device, at its timestamps.
* a second real task takes 2,000 events: after ``retrieval.started`` its lease holder reserves and
  then releases or settles (at zero cost) budget through :mod:`apps.tasks.budget`, the events
  ``reducer/3`` folds; then the real pipeline takes it on to ``WAITING_APPROVAL``, its last event
  (seq 2,000) being ``approval.requested``. ``MAX_EVENTS_PER_TASK`` is raised in-process for
  this; the web does not read it.

One copy and the trace task are replayed against their rows (and their snapshots' digests
checked) before anything is measured. The queue holds exactly 10,000 pending approvals (the
template's, its copies' and the trace task's). Broker messages the steps would enqueue are not
sent (no worker runs here)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from datetime import UTC
from unittest import mock

from tools.bench.harness import Bench, percentile, session_client
from tools.bench.seed import SYMPTOMS, tenant_seed

PENDING = 10_000
TRACE_EVENTS = 2_000
WARMUP = 3
SLUG = "pages"


@contextlib.contextmanager
def _in_process(max_events: int):
    """Steps run here, not by workers: enqueueing is a no-op, and ``MAX_EVENTS_PER_TASK`` is at
    least ``max_events`` (both put back on exit)."""
    from django.conf import settings

    old = settings.FAULTDESK["MAX_EVENTS_PER_TASK"]
    settings.FAULTDESK["MAX_EVENTS_PER_TASK"] = max(old, max_events + 10)
    try:
        with mock.patch("apps.core.queue.send_now", lambda name, *args: None):
            yield
    finally:
        settings.FAULTDESK["MAX_EVENTS_PER_TASK"] = old


def _drive_to_approval(task_id: uuid.UUID, *, rounds: int = 10):
    """Run the agent and tools steps in-process until the task waits for approval; returns the
    task. SystemExit when it stops elsewhere."""
    from apps.agent.runner import agent_run, context_read
    from apps.tasks.models import Task

    task = Task.objects.get(pk=task_id)
    for _ in range(rounds):
        if task.status == "WAITING_APPROVAL":
            return task
        agent_run(task_id=task_id)
        context_read(task_id=task_id)
        task = Task.objects.get(pk=task_id)
    raise SystemExit(f"pages: task {task_id} did not reach WAITING_APPROVAL (it is {task.status}, "
                     f"{task.termination_reason or 'no reason'}) after {rounds} rounds")


def _submit(seeded, device_id: int, symptom: str):
    from django.contrib.auth import get_user_model

    from apps.accounts.principal import principal_for_user
    from apps.tasks.services import task_submit

    requester = get_user_model().objects.get(username=seeded.users["requester"])
    return task_submit(principal=principal_for_user(requester), device_id=device_id, symptom=symptom,
                       urgency="high").task


def _columns(model, **override: str) -> tuple[str, str]:
    """``(column list, select list)`` for copying ``model``'s rows: each column as itself (``src.``)
    unless ``override`` gives its SQL; an auto-increment ``id`` is left to its default."""
    cols, exprs = [], []
    for f in model._meta.concrete_fields:
        if f.primary_key and f.get_internal_type() in ("AutoField", "BigAutoField"):
            continue
        cols.append(f'"{f.column}"')
        exprs.append(override.get(f.column, f'src."{f.column}"'))
    return ", ".join(cols), ", ".join(exprs)


def clone_pending(template, copies: int) -> list[str]:
    """Copy the rows of ``template`` — a task waiting for approval — ``copies`` times with new task
    and approval ids, in one transaction of a few ``INSERT … SELECT`` statements; returns the new
    task ids (str). The approval id inside the task's state, its ``approval.requested`` payload
    (with its digest) and its snapshots (with their digest) follows the new approval row; the
    tenant's day ledger moves by what the copies hold. Nothing else changes: the copies replay to
    their rows."""
    from django.db import connection, transaction
    from django.db.models import F

    from apps.approvals.models import ApprovalRequest
    from apps.core.digests import sha256_json
    from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot
    from apps.tasks.models import Task, TenantUsage

    approval = ApprovalRequest.objects.get(task_id=template.pk, status="PENDING")
    requested = TaskEvent.objects.get(task_id=template.pk, type="approval.requested")
    old_id = str(approval.pk)
    if template.state["approval"]["id"] != old_id or requested.payload["approval_id"] != old_id:
        raise SystemExit(f"pages: template {template.pk}: its approval row, state and event disagree")
    snapshots = list(TaskSnapshot.objects.filter(task_id=template.pk))
    with_approval = [s for s in snapshots if (s.state.get("approval") or {}).get("id") == old_id]
    if any(s.state.get("approval") and s not in with_approval for s in snapshots):
        raise SystemExit(f"pages: template {template.pk} has a snapshot with another approval")
    task_ids = [uuid.uuid4() for _ in range(copies)]
    approval_ids = [uuid.uuid4() for _ in range(copies)]
    event_digests = [sha256_json({**requested.payload, "approval_id": str(a)}) for a in approval_ids]

    def snapshot_digest(a, s):
        return sha256_json({**s.state, "approval": {**s.state["approval"], "id": str(a)}})

    snap_digests = {s.seq: [snapshot_digest(a, s) for a in approval_ids] for s in with_approval}
    state_approval = "jsonb_set(src.state, '{approval,id}', to_jsonb(m.approval_id::text))"
    task_cols, task_sel = _columns(Task, id="m.task_id", state=state_approval)
    event_cols, event_sel = _columns(
        TaskEvent, id="gen_random_uuid()", task_id="m.task_id",
        payload="CASE WHEN src.id = %(requested)s THEN jsonb_set(src.payload, '{approval_id}', "
                "to_jsonb(m.approval_id::text)) ELSE src.payload END",
        payload_digest="CASE WHEN src.id = %(requested)s THEN m.event_digest ELSE src.payload_digest END")
    snap_cols, snap_sel = _columns(
        TaskSnapshot, task_id="m.task_id",
        state="CASE WHEN src.state->'approval'->>'id' = %(old)s THEN jsonb_set(src.state, '{approval,id}', "
              "to_jsonb(m.approval_id::text)) ELSE src.state END",
        digest="CASE WHEN src.state->'approval'->>'id' = %(old)s THEN (m.snapshot_digests->>src.seq::text) "
               "ELSE src.digest END")
    refused_cols, refused_sel = _columns(RefusedEvent, task_id="m.task_id")
    approval_cols, approval_sel = _columns(ApprovalRequest, id="m.approval_id", task_id="m.task_id")
    snap_json = [json.dumps({str(seq): digests[i] for seq, digests in snap_digests.items()})
                 for i in range(copies)]
    params = {"template": template.pk, "requested": requested.pk, "old": old_id}
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("CREATE TEMP TABLE bench_clone_map (task_id uuid, approval_id uuid, event_digest text, "
                    "snapshot_digests jsonb) ON COMMIT DROP")
        cur.execute("INSERT INTO bench_clone_map SELECT * FROM unnest(%s::uuid[], %s::uuid[], %s::text[], "
                    "%s::jsonb[])", [task_ids, approval_ids, event_digests, snap_json])
        for table, cols, sel in ((Task._meta.db_table, task_cols, task_sel),
                                 (TaskEvent._meta.db_table, event_cols, event_sel),
                                 (TaskSnapshot._meta.db_table, snap_cols, snap_sel),
                                 (RefusedEvent._meta.db_table, refused_cols, refused_sel),
                                 (ApprovalRequest._meta.db_table, approval_cols, approval_sel)):
            where = "src.id = %(template)s" if table == Task._meta.db_table else "src.task_id = %(template)s"
            if table == ApprovalRequest._meta.db_table:
                where += " AND src.status = 'PENDING'"
            cur.execute(f"INSERT INTO {table} ({cols}) SELECT {sel} FROM {table} src "  # noqa: S608 - our names
                        f"CROSS JOIN bench_clone_map m WHERE {where}", params)
        limits = template.state.get("limits") or {}
        tokens = limits.get("tokens") or {"used": 0, "reserved": 0}
        day = template.created_at.astimezone(UTC).date()  # the day a task is charged to (apps.tasks.budget)
        TenantUsage.objects.for_tenant(template.tenant_id).filter(day=day).update(
            money_used=F("money_used") + copies * template.budget_used,
            money_reserved=F("money_reserved") + copies * template.budget_reserved,
            tokens_used=F("tokens_used") + copies * tokens["used"],
            tokens_reserved=F("tokens_reserved") + copies * tokens["reserved"])
    return [str(t) for t in task_ids]


def _budget_events(task_id: uuid.UUID, lease, count: int) -> None:
    """``count`` (≥ 2) ledger events on a task in ``RETRIEVING`` through :mod:`apps.tasks.budget`
    under ``lease``: a reservation of one tool call, then its release or its settlement at zero
    cost, alternately (an odd count starts with two reservations released together). One
    transaction, so one commit instead of ``count``; each event is still its service's own
    statements (row lock, CAS update, event insert, snapshot every ``SNAPSHOT_EVERY``)."""
    from django.db import transaction

    from apps.tasks.budget import budget_release, budget_reserve, budget_settle

    actor, gen = f"worker:{lease.owner}", lease.generation
    amounts = {"tool_calls": 1}  # what a context read reserves; no money, so the tenant's day row stays put

    def reserve():
        return budget_reserve(task_id=task_id, activity="bench_filler", amounts=amounts, actor=actor,
                              lease_generation=gen, timeout_s=5.0)[1].id

    def release(*ids):
        budget_release(task_id=task_id, reservation_ids=list(ids), reason="bench: not needed", actor=actor,
                       lease_generation=gen)

    with transaction.atomic():
        made = 0
        if count % 2:
            release(reserve(), reserve())
            made = 3
        for i in range((count - made) // 2):
            rid = reserve()
            if i % 2:
                release(rid)
            else:
                budget_settle(task_id=task_id, reservation_id=rid, used={}, actor=actor, lease_generation=gen)


def trace_task(seeded, device_id: int, *, events: int, tail: int):
    """A real task with exactly ``events`` events: accepted, ``retrieval.started``, then
    ``events - tail`` budget events under its lease holder's fencing token
    (:func:`_budget_events`), then the real pipeline to ``WAITING_APPROVAL``, which takes ``tail``
    events from submission (the template's count). Returns the task; SystemExit when it stops
    elsewhere or with another count."""
    from apps.agent.runner import agent_run
    from apps.tasks.leases import task_claim, task_release
    from apps.tasks.models import Task

    task = _submit(seeded, device_id, SYMPTOMS[1])
    agent_run(task_id=task.pk)
    task = Task.objects.get(pk=task.pk)
    if task.status != "RETRIEVING" or events - tail < 2:
        raise SystemExit(f"pages: trace task {task.pk} is {task.status} at v{task.version}; "
                         f"{events - tail} events to add")
    lease = task_claim(task_id=task.pk)
    if lease is None:
        raise SystemExit(f"pages: could not claim trace task {task.pk}")
    try:
        _budget_events(task.pk, lease, events - tail)
    finally:
        task_release(lease=lease)
    task = _drive_to_approval(task.pk)
    if task.version != events:
        raise SystemExit(f"pages: trace task {task.pk} has {task.version} events, not {events}")
    return task


def seed(*, pending: int = PENDING, events: int = TRACE_EVENTS):
    """Tenant :data:`SLUG` with ``pending`` approvals waiting (a driven template, its copies and the
    trace task's) and a trace task of ``events`` events. One copy and the trace task are replayed
    against their rows and their snapshots' digests checked.

    Returns ``(seeded tenant, trace task, seconds per step)``, the steps being ``tenant`` (with its
    knowledge base, which loads the embedding model), ``template``, ``trace`` and ``copies``.
    SystemExit when a driven task stops elsewhere or a check fails."""
    from apps.core.digests import sha256_json
    from apps.events.models import TaskSnapshot
    from apps.tasks.models import Task
    from apps.tasks.replay import task_replay

    took, mark = {}, time.monotonic()

    def step(name: str) -> None:
        nonlocal mark
        took[name], mark = time.monotonic() - mark, time.monotonic()

    with _in_process(events):
        seeded = tenant_seed(SLUG, devices=2, auto_approve=False, kb=True)
        step("tenant")
        template = _drive_to_approval(_submit(seeded, seeded.devices[0], SYMPTOMS[0]).pk)
        step("template")
        trace = trace_task(seeded, seeded.devices[1], events=events, tail=template.version)
        step("trace")
        copies = clone_pending(template, pending - 2)
        step("copies")
    for task_id in (copies[-1], trace.pk):
        check = task_replay(Task.objects.get(pk=task_id))
        bad = [s.seq for s in TaskSnapshot.objects.filter(task_id=task_id) if sha256_json(s.state) != s.digest]
        if not check.ok or bad:
            raise SystemExit(f"pages: task {task_id} does not replay to its row ({check}) or has snapshots "
                             f"whose digest does not match ({bad})")
    return seeded, trace, took


def measure(client, path: str, n: int, check) -> tuple[list[float], object]:
    """``WARMUP`` GETs of ``path``, then ``n`` timed ones; returns ``(milliseconds, last response)``.
    ``check(response)`` returns a problem (str) or None; a problem or a status other than 200
    raises SystemExit."""
    times = []
    for i in range(WARMUP + n):
        started = time.perf_counter()
        resp = client.get(path)
        elapsed = (time.perf_counter() - started) * 1000
        if resp.status_code != 200:
            raise SystemExit(f"pages: GET {path} answered HTTP {resp.status_code}: {resp.text[:300]}")
        problem = check(resp)
        if problem:
            raise SystemExit(f"pages: GET {path}: {problem}")
        if i >= WARMUP:
            times.append(elapsed)
    return times, resp


def run(bench: Bench, *, requests: int = 100) -> None:
    """Seed (see the module), start gunicorn, and GET the approval queue (as the approver) and the
    2,000-event trace (as the admin) ``requests`` times each after 3 warm-ups. Figures
    ``pages.seed_s`` (s), ``pages.approval_queue_10k.p50_ms`` / ``.p95_ms`` and
    ``pages.trace_2000_events.p50_ms`` / ``.p95_ms`` and the same for ``trace_2000_events_latest``
    and ``trace_2000_events_chart`` (ms, wall time of the whole response seen by
    the client); records the web process's peak RSS. SystemExit when seeding fails or a page
    answers other than 200 or without what it should show."""
    started = time.monotonic()
    seeded, trace, took = seed()
    bench.figure("pages.seed_s", time.monotonic() - started, "s",
                 f"{PENDING:,} pending approvals (1 driven, copied) and a {TRACE_EVENTS:,}-event trace; "
                 + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
    base = f"http://127.0.0.1:{bench.ports['web']}"
    bench.start_web()
    try:
        def queue_ok(resp):
            rows = resp.text.count('class="card approval"')
            if f"{PENDING} approvals pending" not in resp.text:
                return f"the page does not say {PENDING} approvals pending"
            return None if rows == 20 else f"{rows} rows on the first page, not 20"

        from apps.traces.views import EVENTS_PER_PAGE

        last_page = -(-TRACE_EVENTS // EVENTS_PER_PAGE)

        def trace_ok(resp):
            if f"{TRACE_EVENTS} events; events 1–{EVENTS_PER_PAGE} below" not in resp.text:
                return f"the first page does not say {TRACE_EVENTS} events, 1–{EVENTS_PER_PAGE} shown"
            rows = resp.text.count("<tr>") + resp.text.count('<tr class="phase-start">') - 1  # the header row
            return None if rows == EVENTS_PER_PAGE else f"{rows} event rows on the first page"

        def trace_latest_ok(resp):
            last = f"<tr><td>{TRACE_EVENTS}</td>"
            if last not in resp.text and f'class="phase-start"><td>{TRACE_EVENTS}</td>' not in resp.text:
                return f"event {TRACE_EVENTS} is not on the last page"
            return None

        def chart_ok(resp):
            return None if "<polyline" in resp.text else "no chart line"

        trace_url = f"/tasks/{trace.pk}/trace/"
        admin = seeded.users["admin"]
        pages = (("approval_queue_10k", seeded.users["approver"], "/approvals/", queue_ok,
                  f"{PENDING:,} pending, 20 a page"),
                 ("trace_2000_events", admin, trace_url, trace_ok,
                  f"{TRACE_EVENTS:,} events, the first {EVENTS_PER_PAGE}"),
                 ("trace_2000_events_latest", admin, f"{trace_url}?page={last_page}", trace_latest_ok,
                  f"{TRACE_EVENTS:,} events, the last page"),
                 ("trace_2000_events_chart", admin, f"{trace_url}budget/", chart_ok,
                  f"the cost chart over all {TRACE_EVENTS:,} events (the fragment the page loads)"))
        for name, user, path, check, what in pages:
            client = session_client(base, user)
            try:
                times, resp = measure(client, path, requests, check)
            finally:
                client.close()
            note = (f"GET {path}: {what}; HTTP {resp.status_code}, {len(resp.content) / 1024:,.0f} KiB; "
                    f"{requests} requests after {WARMUP} warm-ups")
            bench.figure(f"pages.{name}.p50_ms", percentile(times, 50), "ms", note)
            bench.figure(f"pages.{name}.p95_ms", percentile(times, 95), "ms")
        bench.note_peak("web", "web")
    finally:
        bench.stop("web")
    bench.figure("pages.elapsed_s", time.monotonic() - started, "s")
