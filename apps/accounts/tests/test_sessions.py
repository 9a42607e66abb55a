"""Sessions are written through to the database and read from the shared cache (``SESSION_ENGINE``
``cached_db`` on the ``coordination`` cache, the broker's Redis): a signed-in request reads no
session row, a sign-out ends the session for every process, and a cache that lost the session
falls back to its row."""

from __future__ import annotations

import pytest
from django.contrib.sessions.models import Session
from django.core.cache import caches
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

pytestmark = pytest.mark.django_db


@pytest.fixture
def shared_cache(settings):
    """A coordination cache every request of the test shares (local memory: one process here)."""
    settings.CACHES = {**settings.CACHES, "coordination": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "sessions-test"}}
    yield caches["coordination"]
    caches["coordination"].clear()


def _signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_signed_in_request_reads_its_session_from_the_cache_not_the_table(requester, shared_cache):
    client = _signed_in(requester)
    with CaptureQueriesContext(connection) as queries:
        assert client.get("/api/tasks/").status_code == 200
    assert not [q for q in queries if "django_session" in q["sql"]]
    assert Session.objects.filter(session_key=client.session.session_key).exists(), "written through to its row"


def test_a_sign_out_ends_the_session_everywhere_and_a_lost_cache_falls_back_to_the_row(requester, shared_cache):
    client = _signed_in(requester)
    cookie = client.cookies["sessionid"].value
    shared_cache.clear()  # e.g. Redis restarted without its data: the row still signs the user in
    assert client.get("/api/tasks/").status_code == 200
    client.post("/logout/")
    other = Client()  # another process, holding the same cookie
    other.cookies["sessionid"] = cookie
    assert other.get("/api/tasks/").status_code == 403
    assert not Session.objects.filter(session_key=cookie).exists()
