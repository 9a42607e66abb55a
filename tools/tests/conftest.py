"""Fixtures of the reference ticket service's tests: a temporary SQLite file and a service running
on it in a thread."""

import pytest

from tools.refservice import serve_in_thread
from tools.tests.refservice_http import API_KEY


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "refservice" / "tickets.sqlite3"


@pytest.fixture
def server(db_path):
    srv = serve_in_thread("127.0.0.1", 0, db_path, api_key=API_KEY)
    yield srv
    srv.shutdown()

