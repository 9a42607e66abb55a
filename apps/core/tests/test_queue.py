"""Background work is sent by Celery task name, after the commit and only after it
(apps/core/queue.py; DESIGN.md §2: Redis is a hint to run, PostgreSQL is the truth)."""

from __future__ import annotations

import pytest
from celery import current_app
from django.db import transaction

from apps.core import queue


@pytest.fixture
def sent(monkeypatch):
    """The ``(name, args)`` the broker was handed, in order (Celery's own ``send_task`` records them)."""
    calls = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args=(), **kw: calls.append((name, list(args))))
    return calls


@pytest.mark.django_db(transaction=True)
def test_a_message_leaves_only_when_its_transaction_commits(sent):
    with transaction.atomic():
        queue.enqueue_on_commit(queue.AGENT_STEP, "task-1")
        assert sent == []  # not before the commit
    assert sent == [("agent_step", ["task-1"])]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_sends_nothing(sent):
    with pytest.raises(RuntimeError), transaction.atomic():
        queue.enqueue_on_commit(queue.OUTBOX_DISPATCH)
        raise RuntimeError("rolled back")
    assert sent == []


@pytest.mark.django_db(transaction=True)
def test_arguments_travel_as_strings_and_outside_a_transaction_it_sends_at_once(sent):
    import uuid

    task_id = uuid.UUID("12345678-1234-5678-1234-567812345678")
    queue.enqueue_on_commit(queue.READ_CONTEXT, task_id)
    assert sent == [("read_context", ["12345678-1234-5678-1234-567812345678"])]


@pytest.mark.django_db(transaction=True)
def test_a_broker_that_is_down_is_logged_and_not_raised(monkeypatch, caplog):
    def down(name, args=(), **kw):
        raise ConnectionError("broker down")

    monkeypatch.setattr(current_app, "send_task", down)
    queue.enqueue_on_commit(queue.AGENT_STEP, "task-2")  # must not raise: the sweeper re-queues the work
    assert "could not enqueue agent_step" in caplog.text


def test_each_name_is_a_registered_task_routed_to_its_queue():
    import apps.agent.tasks  # noqa: F401 - registers the runtime's tasks
    import apps.approvals.tasks  # noqa: F401
    import apps.outbox.tasks  # noqa: F401

    expected = {queue.AGENT_STEP: "agent", queue.READ_CONTEXT: "tools", queue.SWEEP_LEASES: "agent",
                queue.EXPIRE_APPROVALS: "agent", queue.OUTBOX_DISPATCH: "outbox", queue.OUTBOX_RECONCILE: "outbox"}
    for name, queue_name in expected.items():
        assert name in current_app.tasks, name
        assert current_app.amqp.router.route({}, name)["queue"].name == queue_name, name


# --- coalesced kicks: at most one dispatcher message waits at a time ------------------------------

@pytest.fixture
def coalescing(settings):
    """Coalescing on, over a cache the test's processes share (one process here: local memory)."""
    from django.core.cache import caches

    settings.CACHES = {**settings.CACHES, "coordination": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "coalescing-test"}}
    settings.FAULTDESK = {**settings.FAULTDESK, "KICK_COALESCE_SECONDS": 30}
    caches["coordination"].delete("faultdesk:kick-waiting:dispatch_pending")
    yield caches["coordination"]
    caches["coordination"].delete("faultdesk:kick-waiting:dispatch_pending")


@pytest.mark.django_db(transaction=True)
def test_commits_while_a_kick_waits_send_nothing_more_until_its_run_starts(sent, coalescing):
    for _ in range(3):
        with transaction.atomic():
            queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert sent == [("dispatch_pending", [])]  # one message for three commits: its run sees all three
    queue.kick_received(queue.OUTBOX_DISPATCH)  # the run started: what commits now needs a new one
    with transaction.atomic():
        queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert sent == [("dispatch_pending", []), ("dispatch_pending", [])]


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_neither_sends_nor_holds_the_flag(sent, coalescing):
    with pytest.raises(RuntimeError), transaction.atomic():
        queue.kick_on_commit(queue.OUTBOX_DISPATCH)
        raise RuntimeError("rolled back")
    queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert sent == [("dispatch_pending", [])]


@pytest.mark.django_db(transaction=True)
def test_a_kick_the_broker_refused_does_not_silence_the_next_commit(monkeypatch, coalescing, caplog):
    calls = []

    def flaky(name, args=(), **kw):
        calls.append(name)
        if len(calls) == 1:
            raise ConnectionError("broker down")

    monkeypatch.setattr(current_app, "send_task", flaky)
    queue.kick_on_commit(queue.OUTBOX_DISPATCH)  # refused: logged, and no flag left behind
    queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert calls == ["dispatch_pending", "dispatch_pending"]
    assert "could not enqueue dispatch_pending" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_failing_cache_means_every_commit_and_every_re_queue_sends(sent, coalescing, monkeypatch):
    def broken(*args, **kwargs):
        raise ConnectionError("cache down")

    with monkeypatch.context() as patch:
        patch.setattr(coalescing, "add", broken)
        patch.setattr(coalescing, "delete", broken)
        queue.kick_on_commit(queue.OUTBOX_DISPATCH)
        queue.kick_on_commit(queue.OUTBOX_DISPATCH)
        queue.kick_received(queue.OUTBOX_DISPATCH)  # never raises
        # the sweeper's re-queue window is a hint too: every re-queue is sent
        assert queue.send_at_most_every(queue.AGENT_STEP, "task-1", seconds=30) is True
        assert queue.send_at_most_every(queue.AGENT_STEP, "task-1", seconds=30) is True
    assert sent == [("dispatch_pending", [])] * 2 + [("agent_step", ["task-1"])] * 2


@pytest.mark.django_db(transaction=True)
def test_the_flag_of_a_lost_kick_expires(sent, coalescing, settings):
    import time

    settings.FAULTDESK = {**settings.FAULTDESK, "KICK_COALESCE_SECONDS": 1}
    queue.kick_on_commit(queue.OUTBOX_DISPATCH)  # say the broker lost it: its run never clears the flag
    queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert len(sent) == 1
    time.sleep(1.1)
    queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert len(sent) == 2


@pytest.mark.django_db(transaction=True)
def test_the_dispatcher_clears_the_flag_before_its_first_claim(sent, coalescing, monkeypatch):
    import apps.outbox.dispatch
    from apps.outbox.tasks import dispatch_pending

    queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    seen = []

    def drain():
        seen.append(coalescing.get("faultdesk:kick-waiting:dispatch_pending"))
        return 0

    monkeypatch.setattr(apps.outbox.dispatch, "outbox_drain", drain)
    dispatch_pending()
    assert seen == [None]


@pytest.mark.parametrize("broker,backend,location", [
    ("redis+socket:///srv/var/run/redis.sock?virtual_host=3", "redis.RedisCache", "unix:///srv/var/run/redis.sock?db=3"),
    ("redis://cache.internal:6379/2", "redis.RedisCache", "redis://cache.internal:6379/2"),
])
def test_the_coordination_cache_follows_the_broker(broker, backend, location):
    from config.cache import coordination_cache

    conf = coordination_cache(broker)
    assert conf == {"BACKEND": f"django.core.cache.backends.{backend}", "LOCATION": location}


@pytest.mark.parametrize("broker", ["amqp://guest@localhost//", "sqs://", "memory://"])
@pytest.mark.django_db(transaction=True)
def test_without_a_shared_store_every_commit_sends(broker, sent, settings):
    """A per-process cache would be wrong (the flag set in one process is cleared in another), so
    with a broker that is not Redis the flag never holds a kick back."""
    from config.cache import coordination_cache

    settings.CACHES = {**settings.CACHES, "coordination": coordination_cache(broker)}
    settings.FAULTDESK = {**settings.FAULTDESK, "KICK_COALESCE_SECONDS": 30}
    for _ in range(3):
        queue.kick_on_commit(queue.OUTBOX_DISPATCH)
    assert sent == [("dispatch_pending", [])] * 3


def test_the_coordination_cache_reaches_the_embedded_redis_over_its_socket():
    from django.core.cache.backends.redis import RedisCache

    from config import embedded
    from config.cache import coordination_cache

    embedded.ensure_redis()
    conf = coordination_cache(embedded.redis_url(9))
    cache = RedisCache(conf["LOCATION"], {})
    cache.delete("faultdesk:kick-waiting:probe")
    assert cache.add("faultdesk:kick-waiting:probe", 1, timeout=5) is True
    assert cache.add("faultdesk:kick-waiting:probe", 1, timeout=5) is False  # SET NX: taken
    cache.delete("faultdesk:kick-waiting:probe")
    assert cache.add("faultdesk:kick-waiting:probe", 1, timeout=5) is True
    cache.delete("faultdesk:kick-waiting:probe")


@pytest.mark.django_db(transaction=True)
def test_a_re_queue_is_sent_at_most_once_per_window_per_task(sent, coalescing, settings):
    import time

    assert queue.send_at_most_every(queue.AGENT_STEP, "task-1", seconds=1) is True
    assert queue.send_at_most_every(queue.AGENT_STEP, "task-1", seconds=1) is False  # still queued, maybe
    assert queue.send_at_most_every(queue.AGENT_STEP, "task-2", seconds=1) is True  # another task
    assert queue.send_at_most_every(queue.READ_CONTEXT, "task-1", seconds=1) is True  # another step
    time.sleep(1.1)
    assert queue.send_at_most_every(queue.AGENT_STEP, "task-1", seconds=1) is True  # lost after all: again
    assert sent == [("agent_step", ["task-1"]), ("agent_step", ["task-2"]), ("read_context", ["task-1"]),
                    ("agent_step", ["task-1"])]
    assert queue.send_at_most_every(queue.AGENT_STEP, "task-1", seconds=0) is True  # no window: always
