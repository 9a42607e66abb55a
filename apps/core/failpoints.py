"""Failpoints for crash tests: make this process die or stall at a named point.

Off unless ``FAULTDESK_FAILPOINT`` names a point. ``FAULTDESK_FAILPOINT_ACTION`` is ``kill``
(SIGKILL this process, the default) or ``sleep:<seconds>``. With ``FAULTDESK_FAILPOINT_ONCE`` set
to a file path, the failpoint fires only once across processes (the file marks that it fired).

Points: ``before_commit:<event type>`` and ``after_commit:<event type>`` (around every task event
commit), ``model_call`` (in the middle of a drafter call), ``before_send`` / ``after_send`` (around
the outbox dispatcher's request).
"""

from __future__ import annotations

import os
import signal
import time


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
    os.kill(os.getpid(), signal.SIGKILL)
