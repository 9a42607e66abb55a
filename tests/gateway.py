"""Tests' way to let the tool gateway reach a server they started: the same setting an operator
uses (``FAULTDESK_GATEWAY_ALLOW_<TOOL>``), never the check turned off."""

from __future__ import annotations

from contextlib import contextmanager

from django.conf import settings
from django.test import override_settings


@contextmanager
def destinations_allowed(tool: str, *urls: str):
    """Within the block, ``tool`` may also reach the destinations of ``urls`` (added to
    ``FAULTDESK["GATEWAY_ALLOW"][tool]``)."""
    conf = settings.FAULTDESK
    allow = dict(conf.get("GATEWAY_ALLOW", {}))
    allow[tool] = [*allow.get(tool, []), *urls]
    with override_settings(FAULTDESK={**conf, "GATEWAY_ALLOW": allow}):
        yield


def allow(settings_fixture, tool: str, *urls: str) -> None:
    """With pytest-django's ``settings`` fixture: ``tool`` may also reach ``urls`` for the test."""
    conf = settings_fixture.FAULTDESK
    allow_ = dict(conf.get("GATEWAY_ALLOW", {}))
    allow_[tool] = [*allow_.get(tool, []), *urls]
    settings_fixture.FAULTDESK = {**conf, "GATEWAY_ALLOW": allow_}


def forget_calls() -> None:
    """Delete every outbound call record of the test database. The gateway writes them on a
    connection of its own, outside the test's transaction, so they outlive the test that made them
    (and a later test that counts purged rows would count them): each test that uses the database
    starts with this — not at the end, where the test's own transaction may still hold some of them
    locked (a purge inside the test)."""
    from django.db import connections

    from apps.gateway import records

    if not str(connections["default"].settings_dict.get("NAME", "")).startswith("test_"):
        return  # the test database is not set up yet: nothing of a test is in it
    try:
        with records._lock:
            records._connection().connection.execute("DELETE FROM gateway_gatewaycall")
    except Exception:  # noqa: BLE001, S110 - no database for this test: nothing was recorded either
        pass
