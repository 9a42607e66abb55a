"""``make bench``: how fast faultdesk is, against this machine's own ceiling (docs/performance.md).

Phases, each printing one line per figure (``python -m tools.bench [--only PHASE ...]``):

1. ``ceiling``  — PostgreSQL's commit rate on this database server: pgbench, simple-update
   (``-N``), several clients (:mod:`tools.bench.ceiling`).
2. ``floor``    — the main job's own work (device read, retrieval, local draft, the reference
   service's ``POST /tickets``, the request written and answered) from a thread pool with no
   events, leases, Celery or outbox (:mod:`tools.bench.floor`).
3. ``e2e``      — N tasks through the whole main job over HTTP, with 1, 2 and 4 Celery worker
   processes (:mod:`tools.bench.e2e`).
4. ``outbox``   — the outbox dispatcher draining a backlog against a no-op remote
   (:mod:`tools.bench.outbox`).
5. ``reads``    — the time to the proposal with the three context reads side by side (``reducer/6``)
   against one after the other (``reducer/5``), with the ticket system's open-ticket read slowed and
   with nothing slow (:mod:`tools.bench.reads`).
6. ``retrieval`` — hybrid retrieval at 10k and 100k chunks, with and without a 1% scope filter:
   latency and recall@10 against exact search (:mod:`tools.bench.retrieval`).
7. ``pages``    — the approval queue with 10,000 pending approvals and a trace of 2,000 events,
   p95 over 100 requests (:mod:`tools.bench.pages`).
8. ``retention`` — the retention purge over a 100,000-task history: table sizes before and after,
   rows and bytes purged per run (:mod:`tools.bench.retention`).
9. ``memory``   — the peak RSS of a worker process and of a web process seen during the run.

Everything runs in its own database (``faultdesk_bench`` on the embedded PostgreSQL, recreated each
run) and Redis database 9; logs go to ``var/bench/logs/``; figures to stdout and to
``var/bench/bench-<UTC time>.json`` (and ``var/bench/latest.json``). No figure is asserted.
"""
