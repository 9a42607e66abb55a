"""Phase 2, the floor: what the main job's work costs on this machine with no durability layer.

One flow is the job's own work, called directly from a thread pool, in autocommit, through the
same functions the job calls: the request written (one INSERT of the task row), the device read,
the device's open-ticket read, the report's retrieval and relevance selection
(:func:`~apps.evidence.relevance.evidence_select`: permission-aware hybrid retrieval with the
query's embedding, then the choice of procedure or the abstention), the report, answers and
evidence screened for instructions, the local drafter, the reference ticket service's
``POST /tickets`` with an idempotency key, the requester's answer composed
(:func:`~apps.tasks.answer.answer_compose`) and written (one UPDATE). Nothing else: no events,
leases, reservations, Celery, outbox, approvals or receipts — so a crash loses work or doubles a
ticket, which is the price the durability layer exists to avoid."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import uuid
from datetime import timedelta

import psycopg

from config import embedded
from tools.bench.harness import DATABASE, Bench, WalCommits, percentile
from tools.bench.seed import SYMPTOMS, tenant_seed


def _flow(seeded, i: int, connector) -> float:
    """One flow; returns its duration in seconds."""
    from django.conf import settings
    from django.utils import timezone

    from apps.agent.context import input_flags
    from apps.devices.selectors import device_read
    from apps.evidence.guard import refs_flags
    from apps.evidence.relevance import evidence_select
    from apps.llm.drafter import local_draft
    from apps.tasks.answer import answer_compose
    from apps.tasks.models import Task
    from apps.tickets.selectors import open_ticket_read

    t0 = time.perf_counter()
    tenant = seeded.tenant
    device_id = seeded.devices[i % len(seeded.devices)]
    symptom = SYMPTOMS[i % len(SYMPTOMS)]
    request = {"symptom": symptom, "urgency": "high"}
    task = Task.objects.create(
        tenant=tenant, requester_id=seeded.requester_id, device_id=device_id, symptom=symptom, urgency="high",
        status="ACCEPTED", state={}, deadline_at=timezone.now() + timedelta(hours=1), budget_total=100,
        artifact_bundle={}, request_digest=uuid.uuid4().hex)
    device = device_read(tenant_id=tenant.pk, device_id=device_id)
    open_ticket_read(tenant_id=tenant.pk, device_id=device_id, connector="reference")
    selection = evidence_select(tenant_id=tenant.pk, scopes=["public", "tier2"], report=symptom, device=device,
                                k=settings.FAULTDESK["RETRIEVAL_TOP_K"])
    refs, chosen = selection.recorded()
    flags = refs_flags(refs) + input_flags(report=symptom, answers=[], reading=device)
    draft = local_draft(request=request, device=device, evidence=refs, tenant=tenant.slug, requester="floor",
                        selection=chosen)
    receipt = connector.create_ticket(idempotency_key=f"floor-{task.pk}", fencing_token=1, params=draft["ticket"])
    answer = answer_compose({"status": "DISPATCHING", "request": request, "device": device, "evidence": refs,
                             "selection": chosen, "receipt": receipt.as_dict(),
                             "proposal": {"tool": "create_ticket", "params": draft["ticket"], "digest": ""}})
    Task.objects.filter(pk=task.pk).update(
        status="COMPLETED", state={"draft": draft, "answer": answer, "flags": flags, "ticket": receipt.external_id},
        updated_at=timezone.now())
    return time.perf_counter() - t0


def run(bench: Bench, *, seconds: float = 15, threads: int = 8) -> None:
    """Run flows from ``threads`` threads for ``seconds`` s after a short warm-up; figures
    ``floor.*``. Needs the reference service, which it starts and stops."""
    from django.contrib.auth import get_user_model
    from django.db import connection

    from apps.tickets.connectors import ReferenceTicketConnector

    seeded = tenant_seed("floor", devices=200)
    seeded.requester_id = get_user_model().objects.get(username=seeded.users["requester"]).pk
    bench.start_refservice("refservice-floor")
    connector = ReferenceTicketConnector()
    conn = psycopg.connect(embedded.postgres_url(DATABASE), autocommit=True)
    counter = iter(range(10**9))
    lock = threading.Lock()
    durations: list[float] = []
    stop_at = [0.0]

    def worker() -> int:
        from django.db import connection as thread_connection

        done = 0
        try:
            while time.monotonic() < stop_at[0]:
                with lock:
                    i = next(counter)
                d = _flow(seeded, i, connector)
                with lock:
                    durations.append(d)
                done += 1
        finally:
            thread_connection.close()
        return done

    try:
        for _ in range(3):  # warm-up: the model, the connection, the first plans
            _flow(seeded, next(counter), connector)
        connection.close()
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
            wal = WalCommits(conn)
            wal.start()
            cpu_before = {**bench.cpu_seconds(["refservice-floor"]), "bench": _own_cpu_seconds()}
            started = time.monotonic()
            stop_at[0] = started + seconds
            flows = sum(pool.map(lambda _: worker(), range(threads)))
            elapsed = time.monotonic() - started
            cpu_after = {**bench.cpu_seconds(["refservice-floor"]), "bench": _own_cpu_seconds()}
            commits, _ = wal.stop()
    finally:
        bench.stop("refservice-floor")
        conn.close()
    bench.figure("floor.flows_per_s", flows / elapsed, "flows/s",
                 f"{flows} flows in {elapsed:.1f} s from {threads} threads of one process")
    bench.figure("floor.flow_p50_ms", percentile(durations, 50) * 1000, "ms")
    bench.figure("floor.flow_p95_ms", percentile(durations, 95) * 1000, "ms")
    bench.figure("floor.commits_per_flow", commits / flows, "commits")
    cpu = {("refservice" if role == "refservice-floor" else role): (cpu_after[role] - cpu_before[role]) * 1000 / flows
           for role in cpu_after if role in cpu_before}
    for role, ms in cpu.items():
        bench.figure(f"floor.cpu_ms_per_flow.{role}", ms, "ms",
                     "CPU (user + system) per flow of the process running the flows" if role == "bench" else "")
    bench.figure("floor.cpu_ms_per_flow.total", sum(cpu.values()), "ms",
                 " + ".join(f"{role} {ms:.1f}" for role, ms in cpu.items()))


def _own_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process so far, all its threads."""
    t = os.times()
    return t.user + t.system
