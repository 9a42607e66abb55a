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
