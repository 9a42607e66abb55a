"""Reading a secret from a mounted file (``*_FILE``), the way container secret stores hand them over.

The settings keep each secret's value (``REFSERVICE_API_KEY``) and the path of a file holding it
(``REFSERVICE_API_KEY_FILE``); :func:`secret_value` picks one. Only the tool gateway
(``apps.gateway.credentials``) and the deploy checks call it: no connector or provider ever holds a
credential (spec agent-execution-system.md §16.6).
"""

from __future__ import annotations

import os
import threading

_CACHE: dict[str, tuple[int, int, str]] = {}
_LOCK = threading.Lock()


def secret_value(value: str, path: str = "") -> str:
    """The secret: the contents of the file at ``path`` when one is named (its surrounding whitespace
    and final newline stripped; re-read when the file changes, so a rotated secret is picked up
    without a restart), else ``value``. Raises ``OSError`` when ``path`` names a file that cannot be
    read: a secret that is configured but missing is an error, never an empty credential."""
    if not path:
        return value or ""
    st = os.stat(path)
    key = (st.st_mtime_ns, st.st_size)
    cached = _CACHE.get(path)
    if cached is not None and cached[:2] == key:
        return cached[2]
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    with _LOCK:
        _CACHE[path] = (*key, text)
    return text
