"""A request the database refuses for now (a lock waited on past ``lock_timeout``) is answered 503
with ``Retry-After`` — JSON under ``/api/`` — and leaves nothing of itself: the client can send it
again. Here a cancel waits at the task's cancel gate, held exclusively by another session as a
request's last re-authorization holds it, past a short lock timeout."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from apps.events.models import TaskEvent
from apps.tasks.cancel_gate import _NAMESPACE, _key
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import p

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def short_lock_timeout():
    """This thread's database session waits at most 300 ms for a lock (a new connection with the
    option; the old one is restored afterwards)."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    before = options.get("options", "")
    connection.close()
    options["options"] = f"{before} -c lock_timeout=300".strip()
    try:
        yield
    finally:
        connection.close()
        options["options"] = before


@pytest.fixture
def gate_held():
    """Another session holds a task's cancel gate exclusively (as a request's re-authorization
    does) until the test ends; yields a function that takes the gate of a task id."""
    params = {k: v for k, v in connection.get_connection_params().items()
              if k not in ("options", "cursor_factory", "context", "prepare_threshold", "client_encoding")}
    other = psycopg.connect(**params)  # one open transaction, rolled back when it closes

    def hold(task_id):
        other.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_NAMESPACE, _key(task_id)])

    yield hold
    other.close()


def test_a_cancel_that_cannot_get_its_lock_in_time_is_a_503_with_retry_after_and_changes_nothing(
        requester, device, short_lock_timeout, gate_held):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task
    gate_held(task.pk)
    client = APIClient()
    client.force_authenticate(requester)
    resp = client.post(f"/api/tasks/{task.pk}/cancel/", {"reason": "fixed itself"}, format="json")
    assert resp.status_code == 503, resp.content
    assert resp["Retry-After"] == "1"
    assert resp.json()["error"] == "busy" and "try again" in resp.json()["detail"]
    assert list(TaskEvent.objects.filter(task_id=task.pk).values_list("type", flat=True)) == ["task.accepted"]
    assert Task.objects.get(pk=task.pk).state.get("cancel_requested") in (None, False)


def test_a_page_the_database_refuses_for_now_is_a_503_page_not_a_server_error(
        requester, device, short_lock_timeout, gate_held):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2").task
    gate_held(task.pk)
    client = Client(raise_request_exception=False)
    client.force_login(requester)
    resp = client.post(f"/tasks/{task.pk}/cancel/", {"reason": "fixed itself"})
    assert resp.status_code == 503 and resp["Retry-After"] == "1"
    assert b"try again" in resp.content
    assert list(TaskEvent.objects.filter(task_id=task.pk).values_list("type", flat=True)) == ["task.accepted"]


def test_only_the_refusal_itself_is_busy_not_an_error_raised_while_handling_one():
    """A real database error raised while a lock timeout was being handled is not "busy": only an
    exception whose own SQLSTATE (or its explicit cause's) is a retryable refusal is."""
    from django.db import OperationalError, ProgrammingError
    from django.test import RequestFactory

    from apps.accounts.middleware import DatabaseBusyMiddleware

    class LockTimeout(Exception):
        sqlstate = "55P03"

    def raised_from(cause):
        try:
            raise OperationalError("canceling statement due to lock timeout") from cause
        except OperationalError as exc:
            return exc

    middleware = DatabaseBusyMiddleware(lambda request: None)
    request = RequestFactory().post("/api/tasks/")
    refusal = raised_from(LockTimeout())
    assert middleware.process_exception(request, refusal).status_code == 503
    try:
        try:
            raise refusal
        except OperationalError:
            raise ProgrammingError("column does not exist")  # noqa: B904 - the case: no "from"
    except ProgrammingError as masked:
        assert middleware.process_exception(request, masked) is None
    assert middleware.process_exception(request, ValueError("not a database error")) is None
