"""Canonical digests (DESIGN.md §6): SHA-256 over RFC 8785 (JCS) canonical JSON, the one way
faultdesk fingerprints a JSON value (actions' h(a), model requests, events' payloads, replayed
states).

:func:`canonical_json` writes the same bytes as ``rfc8785.dumps``, faster: the JSON module's C
encoder (sorted keys, no spaces, UTF-8, the same string escapes as JCS §3.2.2.2) does the work for
every value it writes identically, and ``rfc8785`` formats each float (ECMAScript's number form,
JCS §3.2.2.3). A value outside that common ground — a key beyond U+FFFF (JCS sorts by UTF-16 code
units), a NUL character, a type other than the plain JSON ones — goes to ``rfc8785`` whole, which
also raises its errors."""

from __future__ import annotations

import hashlib
import json
import re

import rfc8785

_INT_MAX = 2**53 - 1  # JCS's integer domain (I-JSON), as rfc8785 checks it
_INT_MIN = -(2**53) + 1
_FLOAT_MARK = re.compile(rb'"\\u0000(\d+)\\u0000"')


class _Uncommon(Exception):
    """The value holds something the C encoder may write differently from JCS."""


def _with_float_marks(value, floats: list):
    """``value`` with every float replaced by a marker string ``"\\0<i>\\0"`` (``floats[i]`` the
    float), the same object where nothing changed. Raises :class:`_Uncommon`."""
    kind = type(value)
    if kind is str:
        if "\x00" in value:
            raise _Uncommon
        return value
    if kind is dict:
        for key in value:
            if type(key) is not str or "\x00" in key or (not key.isascii() and max(key) > "\uffff"):
                raise _Uncommon
        items = value.items()
    elif kind is list or kind is tuple:
        items = enumerate(value)
    else:
        items = None
    if items is not None:
        copied = None
        for key, item in items:
            marked = _with_float_marks(item, floats)
            if marked is not item:
                if copied is None:
                    copied = dict(value) if kind is dict else list(value)
                copied[key] = marked
        return value if copied is None else copied
    if kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise _Uncommon
        return value
    if value is None or kind is bool:
        return value
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise _Uncommon
        floats.append(value)
        return f"\x00{len(floats) - 1}\x00"
    raise _Uncommon


def canonical_json(value) -> bytes:
    """RFC 8785 (JCS) canonical bytes of a JSON-compatible value: byte for byte what
    ``rfc8785.dumps(value)`` returns. Raises ``rfc8785`` errors for values JSON cannot carry (NaN,
    non-string keys, integers beyond 2**53, strings that are not valid Unicode)."""
    floats: list[float] = []
    try:
        marked = _with_float_marks(value, floats)
        out = json.dumps(marked, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                         allow_nan=False).encode("utf-8")
    except (_Uncommon, UnicodeEncodeError, RecursionError):
        return rfc8785.dumps(value)
    if floats:
        out = _FLOAT_MARK.sub(lambda m: rfc8785.dumps(floats[int(m[1])]), out)
    return out


def sha256_json(value) -> str:
    """Hex SHA-256 of :func:`canonical_json` of ``value``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
