"""Fixtures of the gateway's tests."""

from __future__ import annotations

import pytest

from apps.gateway.tests.servers import Recorder


@pytest.fixture
def recorder():
    """Start recording HTTP servers on loopback: ``recorder(answers)`` (see :class:`Recorder`) returns
    one; each is closed after the test."""
    servers = []

    def start(answers=None):
        server = Recorder(answers)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()
