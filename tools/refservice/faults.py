"""Fault injection for ``POST /tickets`` (armed through ``POST /_admin/faults``).

Faults live in memory only: a restart disarms them.
"""

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    """One fault to apply to one request: ``mode`` and, for ``delay``, ``delay_seconds``."""

    mode: str
    delay_seconds: float = 0.0


class FaultInjector:
    """Thread-safe countdown of faults for the next ``POST /tickets`` requests.

    Modes: ``drop_after_commit``, ``fail_503``, ``delay``; ``none`` disarms.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._mode = "none"
        self._remaining = 0
        self._delay_seconds = 0.0

    def arm(self, mode, count=1, delay_seconds=0.0):
        """Apply ``mode`` to the next ``count`` requests (``none`` disarms); return :meth:`state`."""
        with self._lock:
            self._mode = mode
            self._remaining = 0 if mode == "none" else count
            self._delay_seconds = delay_seconds
        return self.state()

    def clear(self):
        """Disarm every fault."""
        self.arm("none")

    def take(self):
        """Use up one armed fault and return it as a :class:`Fault`, or None if none is armed."""
        with self._lock:
            if self._remaining <= 0:
                return None
            self._remaining -= 1
            return Fault(self._mode, self._delay_seconds)

    def state(self):
        """Return ``{"mode", "remaining", "delay_seconds"}``."""
        with self._lock:
            mode = self._mode if self._remaining else "none"
            return {"mode": mode, "remaining": self._remaining, "delay_seconds": self._delay_seconds}
