"""Canonical digests (DESIGN.md §6): SHA-256 over RFC 8785 (JCS) canonical JSON, the one way
faultdesk fingerprints a JSON value (actions' h(a), model requests, replayed states)."""

from __future__ import annotations

import hashlib

import rfc8785


def canonical_json(value) -> bytes:
    """RFC 8785 (JCS) canonical bytes of a JSON-compatible value. Raises ``rfc8785`` errors for
    values JSON cannot carry (NaN, non-string keys, integers beyond 2**53)."""
    return rfc8785.dumps(value)


def sha256_json(value) -> str:
    """Hex SHA-256 of :func:`canonical_json` of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
