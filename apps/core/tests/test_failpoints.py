"""Failpoints (apps.core.failpoints): the ``wait:<path>`` action stalls the process until a test
creates the file, fires once across processes with ``FAULTDESK_FAILPOINT_ONCE``, and does nothing
at a point that is not configured."""

from __future__ import annotations

import threading
import time

from apps.core import failpoints
from apps.core.failpoints import failpoint


def test_wait_stalls_until_the_file_exists_and_fires_only_once(tmp_path, monkeypatch):
    wake, once = tmp_path / "wake", tmp_path / "fired"
    monkeypatch.setenv("FAULTDESK_FAILPOINT", "before_commit:device.read")
    monkeypatch.setenv("FAULTDESK_FAILPOINT_ONCE", str(once))
    monkeypatch.setenv("FAULTDESK_FAILPOINT_ACTION", f"wait:{wake}")
    woken_at = []

    def wake_later():
        time.sleep(0.4)
        woken_at.append(time.monotonic())
        wake.touch()

    threading.Thread(target=wake_later).start()
    failpoint("before_commit:device.read")
    returned_at = time.monotonic()
    assert woken_at and returned_at >= woken_at[0], "the failpoint returned before the file existed"
    assert once.read_text().startswith("before_commit:device.read pid=")
    wake.unlink()
    started = time.monotonic()
    failpoint("before_commit:device.read")  # fired once already: returns at once, though no wake file
    assert time.monotonic() - started < failpoints.WAIT_LIMIT_SECONDS / 10


def test_a_point_that_is_not_configured_does_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTDESK_FAILPOINT", "after_send")
    monkeypatch.setenv("FAULTDESK_FAILPOINT_ACTION", "kill")
    monkeypatch.setenv("FAULTDESK_FAILPOINT_ONCE", str(tmp_path / "fired"))
    failpoint("before_send")  # this process is still alive
    assert not (tmp_path / "fired").exists(), "the failpoint fired at a point it was not set for"


def test_wait_gives_up_after_its_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTDESK_FAILPOINT", "model_call")
    monkeypatch.delenv("FAULTDESK_FAILPOINT_ONCE", raising=False)
    monkeypatch.setenv("FAULTDESK_FAILPOINT_ACTION", f"wait:{tmp_path / 'never'}")
    monkeypatch.setattr(failpoints, "WAIT_LIMIT_SECONDS", 0.3)
    started = time.monotonic()
    failpoint("model_call")
    assert 0.3 <= time.monotonic() - started < 5
