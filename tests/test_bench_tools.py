"""The measuring instruments of ``make bench`` (issue 9), checked against known answers: no figure
of the bench itself is asserted anywhere (speed lives in ``make bench``, never in a timed test)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer

import pytest
from django.db import connection

from apps.tickets.connectors import ReferenceTicketConnector
from config.bench.harness import next_xid, percentile, rss_tree_peak_mb
from config.bench.noop_remote import NoopHandler
from config.bench.profile import summarize


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


def test_peak_rss_of_a_process_tree_counts_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 * 2**20); time.sleep(30)"])  # noqa: S603
    try:
        own = 0.0
        for _ in range(200):  # until the child has touched its buffer
            own, _ = rss_tree_peak_mb(child.pid)
            if own >= 64:
                break
            threading.Event().wait(0.05)
        largest, total = rss_tree_peak_mb(os.getpid())
        assert own >= 64  # the child's 64 MiB buffer
        assert largest >= own and total >= own + 1  # this process plus the child
    finally:
        child.kill()
        child.wait()


@pytest.mark.django_db(transaction=True)
def test_next_xid_counts_writing_transactions_and_reading_it_writes_nothing():
    with connection.cursor() as cur:
        cur.execute("CREATE TEMP TABLE xid_probe (n int)")
        before = next_xid(connection)
        assert next_xid(connection) == before  # reading assigns no transaction id
        cur.execute("SELECT count(*) FROM xid_probe")  # a read-only transaction neither
        for n in range(5):
            cur.execute("INSERT INTO xid_probe VALUES (%s)", [n])  # autocommit: one transaction each
        assert next_xid(connection) == before + 5


def test_the_noop_remote_answers_the_reference_connector_as_a_created_ticket():
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoopHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        connector = ReferenceTicketConnector(base_url=f"http://127.0.0.1:{server.server_port}", api_key="k",
                                             timeout=5)
        first = connector.create_ticket(idempotency_key="k-1", fencing_token=1, params={"title": "t"})
        second = connector.create_ticket(idempotency_key="k-2", fencing_token=1, params={"title": "t"})
        assert first.external_id != second.external_id
        assert first.external_id.startswith("NOOP-") and first.version == 1 and not first.replayed
        assert connector.lookup_by_key(idempotency_key="k-1") is None  # it stores nothing
    finally:
        server.shutdown()
        server.server_close()
