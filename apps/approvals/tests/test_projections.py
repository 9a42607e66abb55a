"""The pending-approvals projection (apps/approvals/projections.py): a task that ends or is
cancelled leaves no approval pending, and a task that never asked for one costs no statement."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest

from apps.approvals.projections import pending_approvals_close

pytestmark = pytest.mark.django_db


def _task(**state):
    return SimpleNamespace(pk=uuid.uuid4(), tenant_id=1, status="EXECUTING",
                           state={"approval": None, "compensation": None, **state})


@pytest.mark.parametrize("event_type,status", [("task.completed", "COMPLETED"), ("cancel.requested", "EXECUTING")])
def test_a_task_that_never_asked_for_an_approval_ends_without_a_statement(event_type, status,
                                                                          django_assert_num_queries):
    task = _task()
    with django_assert_num_queries(0):
        pending_approvals_close(task, SimpleNamespace(type=event_type), {**task.state, "status": status})


@pytest.mark.parametrize("key", ["approval", "compensation"])
def test_a_task_that_asked_for_one_closes_its_pending_rows(key, django_assert_num_queries):
    task = _task(**{key: {"id": str(uuid.uuid4()), "status": "APPROVED"}})
    with django_assert_num_queries(1):
        pending_approvals_close(task, SimpleNamespace(type="task.completed"), {**task.state, "status": "COMPLETED"})


def test_an_event_that_neither_ends_nor_cancels_costs_nothing(django_assert_num_queries):
    task = _task(approval={"id": "x", "status": "PENDING"})
    with django_assert_num_queries(0):
        pending_approvals_close(task, SimpleNamespace(type="receipt.recorded"), {**task.state, "status": "EXECUTING"})
