"""The signature on the reference ticket service's webhooks (DESIGN.md §11), shared by both sides:
the reference ticket service (a development tool, not the product) signs each delivery and
:mod:`apps.tickets.webhooks` verifies it.

``X-Refservice-Signature: t=<unix seconds>,v1=<hex>`` where ``hex`` is HMAC-SHA256(secret,
``f"{t}."`` + raw body). The receiver recomputes it and rejects a ``t`` too far from its own clock
(a replay of an old delivery).
"""

import hashlib
import hmac
import time


def sign(secret, body, timestamp=None):
    """Return the ``X-Refservice-Signature`` value for raw ``body`` bytes at ``timestamp``
    (unix seconds, default now)."""
    t = int(time.time() if timestamp is None else timestamp)
    digest = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={digest}"


def verify(secret, body, header, *, tolerance_seconds=300, now=None):
    """Check a signature header against raw ``body`` bytes. Returns ``(ok, reason)``; ``reason``
    says what failed: ``"missing"``, ``"malformed"``, ``"expired"`` (``t`` more than
    ``tolerance_seconds`` away from ``now``) or ``"mismatch"``."""
    if not header:
        return False, "missing"
    parts = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
    try:
        if not (parts["t"].isascii() and len(parts["t"].lstrip("-")) <= 12):
            raise ValueError("t: not a unix time")  # int("1" * 400) - now would overflow a float
        t = int(parts["t"])
        supplied = parts["v1"]
    except (KeyError, ValueError):
        return False, "malformed"
    current = time.time() if now is None else now
    if abs(current - t) > tolerance_seconds:
        return False, "expired"
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    # Bytes, not str: compare_digest refuses a non-ASCII str (a forged header must not be a 500).
    if not hmac.compare_digest(expected.encode(), supplied.encode("utf-8", "surrogateescape")):
        return False, "mismatch"
    return True, ""
