"""Failpoints for crash tests: make this process die or stall at a named point.

Off unless ``FAULTDESK_FAILPOINT`` names a point. ``FAULTDESK_FAILPOINT_ACTION`` is ``kill``
(SIGKILL this process, the default), ``sleep:<seconds>``, or ``wait:<path>`` (stall until the file
``path`` exists, at most :data:`WAIT_LIMIT_SECONDS`, so a test wakes the process exactly when it
has seen what it waits for rather than after a guessed time). With ``FAULTDESK_FAILPOINT_ONCE`` set
to a file path, the failpoint fires only once across processes (the file marks that it fired).

Points: ``before_commit:<event type>`` and ``after_commit:<event type>`` (around every task event
commit), ``model_call`` (in the middle of a drafter call), ``before_send`` / ``after_send`` (around
the outbox dispatcher's request).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

WAIT_LIMIT_SECONDS = 300.0


def failpoint(name: str) -> None:
    """Fire the configured action if ``name`` is the configured failpoint; otherwise do nothing."""
    if os.environ.get("FAULTDESK_FAILPOINT") != name:
        return
    once = os.environ.get("FAULTDESK_FAILPOINT_ONCE")
    if once:
        try:
            fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{name} pid={os.getpid()}\n".encode())
        os.close(fd)
    action = os.environ.get("FAULTDESK_FAILPOINT_ACTION", "kill")
    if action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
        return
    if action.startswith("wait:"):
        wake, limit = Path(action.split(":", 1)[1]), time.monotonic() + WAIT_LIMIT_SECONDS
        while not wake.exists() and time.monotonic() < limit:
            time.sleep(0.1)
        return
    os.kill(os.getpid(), signal.SIGKILL)
