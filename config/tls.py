"""One TLS context per process for outbound HTTP (issue 9's profile).

``httpx.Client()`` builds a fresh ``ssl.SSLContext`` — loading and parsing the whole CA bundle —
every time it is constructed, even for an ``http://`` URL that never uses it. The connectors make
a client per call (a fresh connection per request is what their outcome classification assumes),
so that was 12–16% of a worker's CPU, about 30 ms per task. The context holds no per-connection
state, so every client of the process can share it."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's TLS context: what ``httpx.Client(verify=True)`` would build (certifi's CA
    bundle, ``SSL_CERT_FILE``/``SSL_CERT_DIR`` honoured), built once."""
    return httpx.create_ssl_context()
