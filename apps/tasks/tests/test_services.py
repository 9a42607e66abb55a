"""A requester's Idempotency-Key and tasks are the requester's own: another requester of the same
tenant reusing a key files their own request and learns nothing of the first (no 422 carrying its
id, nothing to squat), and cancelling or answering another requester's task is answered exactly as
for an id that does not exist (404), so ids cannot be probed."""

from __future__ import annotations

import uuid

import pytest
from rest_framework.test import APIClient

from apps.accounts.models import Role
from apps.tasks.models import Task
from tests.factories import MembershipFactory, UserFactory

BODY = {"symptom": "Fuser error after warm-up, pages come out smeared.", "urgency": "high"}


@pytest.fixture
def rhea(tenant):
    """A second requester of acme."""
    return MembershipFactory(user=UserFactory(username="rhea"), tenant=tenant, role=Role.REQUESTER).user


def _api(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def test_another_requesters_same_key_files_their_own_request(requester, rhea, device):
    riley, other = _api(requester), _api(rhea)
    first = riley.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert first.status_code == 201
    squat = other.post("/api/tasks/", {"device_id": device.pk, "symptom": "Something else.", "urgency": "low"},
                       format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert squat.status_code == 201 and squat.json()["id"] != first.json()["id"]
    assert first.json()["id"] not in squat.content.decode()
    # The same requester's own key still deduplicates, and a different body is still refused.
    again = riley.post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    changed = riley.post("/api/tasks/", {**BODY, "device_id": device.pk, "urgency": "low"}, format="json",
                         HTTP_IDEMPOTENCY_KEY="k-1")
    assert changed.status_code == 422 and changed.json()["task_id"] == first.json()["id"]
    assert Task.objects.count() == 2


@pytest.mark.parametrize("path, body", [("cancel", {"reason": "x"}), ("input", {"text": "since Monday"})])
def test_another_requesters_task_is_answered_like_one_that_does_not_exist(requester, rhea, device, path, body):
    task = _api(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()
    other = _api(rhea)
    theirs = other.post(f"/api/tasks/{task['id']}/{path}/", body, format="json")
    absent = other.post(f"/api/tasks/{uuid.uuid4()}/{path}/", body, format="json")
    assert theirs.status_code == absent.status_code == 404
    assert theirs.json() == absent.json()
    assert Task.objects.get(pk=task["id"]).status == "ACCEPTED"


def test_an_approver_who_sees_the_task_is_told_it_is_forbidden(requester, approver, device):
    task = _api(requester).post("/api/tasks/", {**BODY, "device_id": device.pk}, format="json").json()
    assert _api(approver).post(f"/api/tasks/{task['id']}/cancel/", {"reason": "x"}, format="json").status_code == 403


@pytest.mark.django_db(transaction=True)  # the submit's transaction is the outermost one, as in a request
def test_a_submit_writes_the_task_row_and_its_accepted_event_in_one_statement(requester, device):
    """The new row (at version 1, as δ leaves it) and ``task.accepted`` (seq 1) go in one statement
    with no savepoint; what they hold is what a replay of the event gives."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.events.models import TaskEvent
    from apps.tasks.replay import task_replay
    from apps.tasks.services import task_submit
    from tests.conftest import p

    with CaptureQueriesContext(connection) as queries:
        task = task_submit(principal=p(requester), device_id=device.pk, symptom="Toner low warning",
                           request_key="one-statement").task
    statements = [q["sql"].lstrip() for q in queries]
    writes = [s for s in statements if "INSERT INTO" in s]
    assert len(writes) == 1 and writes[0].startswith("WITH t AS (INSERT INTO \"tasks_task\"")
    assert "events_taskevent" in writes[0]
    assert not [s for s in statements if s.startswith(("SAVEPOINT", "UPDATE"))]
    row = Task.objects.get(pk=task.pk)
    [event] = TaskEvent.objects.filter(task=row)
    assert (row.version, row.status, event.seq, event.type) == (1, "ACCEPTED", 1, "task.accepted")
    assert (task.version, task.state) == (row.version, row.state)
    assert event.payload["request"]["symptom"] == "Toner low warning"
    assert task_replay(row, use_snapshot=False).ok
