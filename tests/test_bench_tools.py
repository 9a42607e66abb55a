"""The measuring instruments of ``make bench`` (docs/performance.md), checked against known answers:
no figure of the bench itself is asserted anywhere (speed lives in ``make bench``, never in a timed
test)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading

import pytest
from django.db import connection, transaction

from apps.tickets.connectors import ReferenceTicketConnector
from tests.gateway import destinations_allowed
from tools.bench.harness import WalCommits, percentile
from tools.bench.noop_remote import serve as noop_serve
from tools.bench.profile import summarize


def test_percentile_interpolates_between_closest_ranks_like_numpy():
    data = [15, 20, 35, 40, 50]
    assert percentile(data, 0) == 15
    assert percentile(data, 50) == 35
    assert percentile(data, 100) == 50
    assert percentile(data, 40) == pytest.approx(29.0)  # numpy.percentile(data, 40) = 29.0
    assert percentile(data, 95) == pytest.approx(48.0)  # numpy.percentile(data, 95) = 48.0
    assert percentile([7], 95) == 7
    assert percentile([], 50) != percentile([], 50)  # NaN for no values


def test_profile_summary_sums_stacks_per_function_inclusive_and_self(tmp_path):
    raw = tmp_path / "stacks.txt"
    raw.write_text(
        "process 1;run (apps/tasks/tasks.py:10);embed (apps/evidence/embedding.py:5) 6\n"
        "process 1;run (apps/tasks/tasks.py:10);append (apps/tasks/services.py:9);run (apps/tasks/tasks.py:12) 3\n"
        "thread 2;wait (psycopg/connection.py:1) 1\n"
    )
    result = summarize(raw)
    assert result["samples"] == 10
    inclusive = dict(result["inclusive"])
    # a function that appears twice in one stack (recursion) counts once for that stack
    assert inclusive["run (apps/tasks/tasks.py)"] == pytest.approx(0.9)
    assert inclusive["embed (apps/evidence/embedding.py)"] == pytest.approx(0.6)
    assert inclusive["append (apps/tasks/services.py)"] == pytest.approx(0.3)
    assert dict(result["self"]) == {"embed (apps/evidence/embedding.py)": pytest.approx(0.6),
                                    "run (apps/tasks/tasks.py)": pytest.approx(0.3),
                                    "wait (psycopg/connection.py)": pytest.approx(0.1)}


@pytest.mark.django_db(transaction=True)
def test_wal_commits_count_writing_transactions_and_not_reads():
    from apps.accounts.models import Tenant

    connection.ensure_connection()
    wal = WalCommits(connection.connection)
    wal.start()
    for n in range(5):
        Tenant.objects.create(slug=f"wal-{n}", name="w")  # autocommit: one transaction each
    assert Tenant.objects.count() == 5  # a read-only transaction writes no commit record
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        Tenant.objects.create(slug="wal-rolled-back", name="w")
        1 / 0  # noqa: B018 - rolled back: no commit record (its abort record is not flushed at once)
    commits, _ = wal.stop()
    assert commits == 5
    with connection.cursor() as cur:  # the slot that held the WAL is gone
        cur.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", [wal.slot])
        assert cur.fetchone()[0] == 0


@contextlib.contextmanager
def _noop_remote():
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(noop_serve, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with destinations_allowed("ticket.reference", url):
            yield url
    finally:
        async def stop():
            server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.mark.parametrize("keep_alive", [False, True])
def test_the_noop_remote_answers_the_reference_connector_as_a_created_ticket(keep_alive):
    with _noop_remote() as url:
        connector = ReferenceTicketConnector(base_url=url, timeout=5)
        connector.keep_alive = keep_alive
        first = connector.create_ticket(idempotency_key="k-1", fencing_token=1, params={"title": "t"})
        second = connector.create_ticket(idempotency_key="k-2", fencing_token=1, params={"title": "打印机"})
        assert first.external_id != second.external_id
        assert first.external_id.startswith("NOOP-") and first.version == 1 and not first.replayed
        assert connector.lookup_by_key(idempotency_key="k-1") is None  # it stores nothing


def test_the_noop_remote_answers_a_batch_with_a_ticket_per_item_key():
    with _noop_remote() as url:
        connector = ReferenceTicketConnector(base_url=url, timeout=5)
        items = [("k-1", 1, {"title": "t"}), ("k-2", 1, {"title": "打印机"}), ("k-3", 2, {"title": "t"})]
        receipts = connector.create_tickets(items, timeout=5)
        assert [r.body["idempotency_key"] for r in receipts] == ["k-1", "k-2", "k-3"]
        assert len({r.external_id for r in receipts}) == 3 and all(r.external_id.startswith("NOOP-") for r in receipts)


def test_the_noop_remote_refuses_what_it_does_not_serve():
    import httpx

    with _noop_remote() as url, httpx.Client(base_url=url) as client:
        assert client.get("/healthz").json() == {"ok": True}
        assert client.post("/elsewhere", json={"a": 1}).status_code == 404
        assert client.delete("/tickets").status_code == 404
        assert client.post("/tickets", json={}, headers={"Connection": "close"}).status_code == 201


@pytest.mark.django_db
def test_the_retrieval_bench_loads_chunks_the_products_own_selectors_retrieve():
    """The bench's bulk load writes every column the product's retrieval filters on (in force,
    governed, the configured embedding model), so what it times is the product's query over rows the
    product would return, not a query over rows it skips."""
    import numpy as np

    from apps.accounts.models import Tenant
    from apps.evidence.selectors import text_candidates, vector_candidates, vector_literal
    from tools.bench.retrieval import CHUNKS_PER_DOCUMENT, FILTERS, _Corpus, _load

    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(4, 512)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    sentences = [("Safety", "Switch the printer off before opening the fuser cover panel."),
                 ("Diagnosis", "Measure the thermistor resistance at the fuser connector first."),
                 ("Escalation", "Escalate a swollen battery module to the facilities team at once."),
                 ("Diagnosis", "Reseat the network cable and check the link light on the port.")]
    tenant = Tenant.objects.create(slug="bench-load-check", name="Bench load check")
    added, _ = _load(tenant, _Corpus(sentences, vectors), first_doc=0, n=12)
    assert added == -(-12 // CHUNKS_PER_DOCUMENT)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM evidence_chunk WHERE tenant_id = %s", [tenant.pk])
        assert cur.fetchone()[0] == 12
        ids, _strategy = vector_candidates(cur, tenant_id=tenant.pk, scopes=FILTERS["all"],
                                           qvec=vector_literal(vectors[0]), limit=50)
        assert len(ids) == 12
        cur.execute("SELECT id FROM evidence_chunk WHERE tenant_id = %s AND text LIKE '%%thermistor%%'",
                    [tenant.pk])
        with_the_word = {r[0] for r in cur.fetchall()}
        assert with_the_word  # the seeded draw uses every sentence among 12 chunks
        found = text_candidates(cur, tenant_id=tenant.pk, scopes=FILTERS["all"], query="thermistor", limit=50)
        assert set(found) == with_the_word


def test_cpu_tree_seconds_counts_a_busy_child_and_the_children_it_reaped():
    import subprocess
    import sys
    import time

    from tools.bench.harness import _process_tree, cpu_tree_seconds

    # a parent that runs one busy child to its end (reaped: counted in the parent's cutime), then
    # starts a second busy child and waits on it (alive: counted from its own stat)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    script = (f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {burn!r}])\n"
              f"p = subprocess.Popen([sys.executable, '-c', {burn!r} + 'import time; time.sleep(30)'])\n"
              "p.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", script])  # noqa: S603
    try:
        deadline = time.monotonic() + 30
        seconds = 0.0
        while time.monotonic() < deadline:
            seconds = cpu_tree_seconds(parent.pid)
            if seconds >= 0.8:
                break
            time.sleep(0.1)
        assert seconds >= 0.8  # both children's 0.4 s of CPU, the first one already gone
        assert cpu_tree_seconds(parent.pid) < 10  # and not wildly more (no double counting of ticks)
    finally:
        for pid in reversed(_process_tree(parent.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(10)
    assert cpu_tree_seconds(parent.pid) == 0.0  # a reaped process has no stat to read


@pytest.mark.django_db(transaction=True)
def test_sql_statements_counts_other_sessions_statements_and_not_its_own():
    import psycopg

    from tools.bench.harness import SqlStatements

    params = {k: v for k, v in connection.get_connection_params().items()
              if k in ("dbname", "user", "password", "host", "port")}
    watcher = psycopg.connect(autocommit=True, **params)
    other = psycopg.connect(**params)  # opened before counting starts: it must pick up the setting too
    try:
        counter = SqlStatements(watcher)
        counter.start()
        for _ in range(3):
            watcher.execute("SELECT 1")  # the counter's own connection: not counted
        with other.transaction():
            for n in range(4):
                other.execute("SELECT %s::int", [n])
        statements, control = counter.stop()
        assert statements == 4
        assert control >= 2  # BEGIN and COMMIT of the transaction
        with watcher.cursor() as cur:  # switched off again: no longer in the server's configuration
            cur.execute("SELECT count(*) FROM pg_file_settings WHERE name = 'log_statement'")
            assert cur.fetchone()[0] == 0
    finally:
        other.close()
        watcher.close()


def test_a_report_whose_kept_alive_connection_was_closed_is_resent_with_the_same_key():
    """gunicorn closes a session's idle kept-alive connection after 2 s; the next POST on it fails
    before any response. The load generator resends with the same Idempotency-Key (at most one
    task), instead of stopping the bench."""
    import httpx

    from tools.bench.e2e import submit_all

    class Client:
        def __init__(self):
            self.keys = []

        def post(self, path, json, headers):
            self.keys.append(headers["Idempotency-Key"])
            if len(self.keys) == 1:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return httpx.Response(201, json={"id": f"task-{json['device_id']}"})

    client = Client()
    assert submit_all("http://web", "requester", [7, 8], 2, prefix="p", clients=[client]) == ["task-7", "task-8"]
    assert client.keys == ["p-0", "p-0", "p-1"]


def test_time_to_proposal_runs_from_acceptance_to_the_first_approval_or_intent_whatever_the_order():
    from tools.bench.reads import time_to_proposal

    events = [("ticket.read", 11.0), ("approval.requested", 12.5), ("task.accepted", 10.0),
              ("intent.committed", 14.0), ("device.read", 10.2)]
    assert time_to_proposal(events) == pytest.approx(2.5)
    # no approval asked: the intent is the proposal
    assert time_to_proposal([("task.accepted", 3.0), ("intent.committed", 3.25)]) == pytest.approx(0.25)
    assert time_to_proposal([("task.accepted", 3.0), ("device.read", 3.1), ("task.failed", 3.2)]) is None
    assert time_to_proposal([("approval.requested", 3.0)]) is None


def test_proposal_spans_split_the_time_at_the_first_worker_event_and_the_last_read_before_the_proposal():
    from tools.bench.reads import proposal_spans

    # reducer/6: the dispatch, three reads reported apart, the proposal; then a re-plan's read (not counted)
    events = [("task.accepted", 100.0), ("retrieval.started", 100.010), ("plan.activated", 100.011),
              ("budget.reserved", 100.012), ("device.read", 100.030), ("evidence.retrieved", 100.060),
              ("ticket.read", 101.040), ("draft.proposed", 101.045), ("approval.requested", 101.050),
              ("ticket.read", 105.0)]
    spans = proposal_spans(events)
    assert spans == {"total": pytest.approx(1.050), "start": pytest.approx(0.010), "reads": pytest.approx(1.030),
                     "after": pytest.approx(0.010)}
    assert spans["start"] + spans["reads"] + spans["after"] == pytest.approx(spans["total"])
    assert proposal_spans([("task.accepted", 1.0), ("approval.requested", 1.2)]) is None  # no read: no split
    assert proposal_spans([("task.accepted", 1.0), ("device.read", 1.1)]) is None  # no proposal


def test_report_waits_measure_the_local_reads_the_hop_to_the_ticket_read_and_its_wait_to_report():
    from tools.bench.reads import report_waits

    events = [("task.accepted", 0.0, None), ("budget.reserved", 0.009, None), ("budget.reserved", 0.010, None),
              ("budget.reserved", 0.011, None), ("device.read", 0.040, 0.015), ("evidence.retrieved", 0.041, 0.038),
              ("ticket.read", 0.140, 0.128), ("budget.reserved", 0.142, None), ("approval.requested", 0.150, None)]
    waits = report_waits(events)
    assert waits["local"] == pytest.approx(0.030)  # the last reservation → the local reads reported (0.041)
    assert waits["hop"] == pytest.approx(0.117)  # → the ticket read finished (0.128)
    assert waits["report"] == pytest.approx(0.012)  # finished at 0.128, recorded at 0.140
    assert report_waits([("task.accepted", 0.0, None), ("approval.requested", 0.1, None)]) is None
    assert report_waits([("device.read", 0.03, 0.02)]) is None  # no ticket read
    assert report_waits([("budget.reserved", 0.01, None), ("ticket.read", 0.05, 0.04)]) == {
        "local": None, "hop": pytest.approx(0.03), "report": pytest.approx(0.01)}


def test_the_reads_worker_takes_the_slow_retrievals_seconds_from_its_file(tmp_path):
    from tools.bench.reads_worker import slow_retrieval_seconds

    f = tmp_path / "slow"
    assert slow_retrieval_seconds(None) == 0.0 and slow_retrieval_seconds(str(f)) == 0.0  # no file: no sleep
    for text, seconds in (("1.0", 1.0), ("0", 0.0), ("", 0.0), ("soon", 0.0), ("-2", 0.0)):
        f.write_text(text)
        assert slow_retrieval_seconds(str(f)) == seconds
