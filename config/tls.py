"""One TLS context per process for outbound HTTP (the bench's profile; docs/performance.md).

``httpx.Client()`` builds a fresh ``ssl.SSLContext`` — loading and parsing the whole CA bundle —
every time it is constructed, even for an ``http://`` URL that never uses it. The connectors make
a client per call (a fresh connection per request is what their outcome classification assumes),
so that was 12–16% of a worker's CPU, about 30 ms per task. The context holds no per-connection
state, so every client of the process can share it."""

from __future__ import annotations

import functools
import os
import ssl
import threading

import httpx


def tls_context() -> ssl.SSLContext:
    """The process's TLS context: what ``httpx.Client(verify=True)`` would build now (certifi's CA
    bundle, or ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set), built once per value of those two."""
    # Under a lock: the outbox's sender threads ask at the same moment, and eight concurrent first
    # calls each built their own (0.4 s of CPU in a process where one build takes 25 ms).
    with _LOCK:
        return _context_for(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


_LOCK = threading.Lock()


@functools.cache
def _context_for(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return httpx.create_ssl_context()
