"""Lease claims with fencing tokens (DESIGN.md §5; spec §16.3): :func:`task_claim_read` claims as
:func:`task_claim` does — committed by itself, a new fencing token each time — and reads the task,
as the claim left it, in the same statement."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.tasks import reducer
from apps.tasks.leases import task_claim, task_claim_read, task_release
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import p

pytestmark = pytest.mark.django_db(transaction=True)


def _lease_elsewhere(task_id):
    """``(lease_owner, lease_generation)`` as another session sees it (what is committed)."""
    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    with psycopg.connect(**params, autocommit=True) as other:
        return other.execute("SELECT lease_owner, lease_generation FROM tasks_task WHERE id = %s",
                             [task_id]).fetchone()


@pytest.fixture
def accepted(requester, device):
    return task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task


def test_a_claim_that_reads_commits_alone_and_returns_the_row_it_claimed_with_its_relations(accepted):
    with CaptureQueriesContext(connection) as queries:
        lease, task = task_claim_read(task_id=accepted.pk, related=("device", "tenant", "requester"))
        got = (task.device.asset_tag, task.tenant.pk, task.requester.pk)
    assert len(queries) == 1, "the claim and the read are one statement; the relations need no other"
    assert got == (accepted.device.asset_tag, accepted.tenant_id, accepted.requester_id)
    assert (task.pk, task.version, task.status, task.state) == \
        (accepted.pk, accepted.version, accepted.status, Task.objects.get(pk=accepted.pk).state)
    assert (task.lease_owner, task.lease_generation) == (lease.owner, lease.generation) == \
        _lease_elsewhere(accepted.pk), "committed by itself: another session sees the lease at once"


def test_each_claim_that_reads_gets_a_fencing_token_of_its_own_and_a_held_lease_is_skipped(accepted):
    first, _ = task_claim_read(task_id=accepted.pk)
    assert task_claim_read(task_id=accepted.pk) is None, "a live lease is another worker's"
    assert task_claim(task_id=accepted.pk) is None
    task_release(lease=first)
    second, task = task_claim_read(task_id=accepted.pk)
    assert second.generation == first.generation + 1 == task.lease_generation
    task_release(lease=second)
    Task.objects.filter(pk=accepted.pk).update(status=reducer.COMPLETED)
    assert task_claim_read(task_id=accepted.pk) is None, "a terminal task with nothing due is not claimed"
