"""Keeping a tool's credential out of what the gateway hands back (ADR 0022; spec
agent-execution-system.md §16.6: "凭证由网关注入而非放进模型上下文").

An upstream may echo the request's credential — in an error body, a header, an SMTP reply — and an
exception raised on the way out may quote it. What a caller keeps (an error it records, a body it
reads) must never hold it, in any form the caller could decode back: the raw value, its JSON,
``repr`` and percent-encoded escapes, each of its lines when it spans several, and — for a body —
the text the caller decodes with the answer's charset and the strings of its JSON.

This is the one module of the gateway other apps may import (for :func:`redact`); the credentials
themselves stay in :mod:`apps.gateway.credentials`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
from urllib.parse import quote, quote_plus

from apps.core.jsonwalk import strings_of
from apps.gateway import credentials, tools

MASK = "[redacted]"
#: a line of a several-line credential shorter than this is not masked on its own (it would mask
#: common words: a credential's lines are keys, each long)
_MIN_LINE = 8
#: a run of base64 (standard or URL-safe) long enough to hold a credential
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{12,}={0,2}")
#: how deep JSON inside a JSON string (inside a JSON string …) is looked into
_MAX_NESTING = 4


def _percent_forms(value: str) -> set[str]:
    encoded = {quote(value, safe=""), quote(value), quote_plus(value), quote_plus(value, safe="/")}
    return encoded | {re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), e) for e in encoded}


@functools.lru_cache(maxsize=64)
def forms(value: str) -> tuple[str, ...]:
    """Every literal spelling of the credential ``value`` a text could hold and decode back to it,
    longest first (so a longer form is masked before a form it contains): the value, its JSON string
    escapes (with and without ``\\/`` and ``\\uXXXX`` for non-ASCII), its ``repr`` escapes, its
    percent-encodings (upper- and lower-case hex, ``+`` for a space), and each of its lines (stripped)
    of 8 characters or more. Empty for an empty value. (Base64 and JSON inside strings are found by
    :func:`scrub`, which decodes them.)"""
    if not value:
        return ()
    found = {value, repr(value)[1:-1], json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}
    found |= _percent_forms(value)
    found |= {f.replace("/", "\\/") for f in list(found)}
    if "\n" in value or "\r" in value:
        for line in value.splitlines():
            line = line.strip()
            if len(line) >= _MIN_LINE:
                found |= set(forms(line))
    return tuple(sorted(found, key=len, reverse=True))


def _base64_holds(run: str, value: bytes) -> bool:
    """Whether the base64 ``run`` (standard or URL-safe, padded or not) decodes to bytes holding ``value``."""
    stripped = run.rstrip("=")
    padded = stripped + "=" * (-len(stripped) % 4)
    for altchars in (None, b"-_"):
        try:
            if value in base64.b64decode(padded, altchars=altchars):
                return True
        except (binascii.Error, ValueError):
            continue
    return False


def _escaped_json(text: str) -> bool:
    """Whether ``text`` may be JSON whose strings read otherwise than they are written: it starts as
    JSON does and holds an escape. (Without a backslash every string of a JSON text is written as it
    reads, so the literal and base64 checks on the whole text have seen it already.)"""
    return "\\" in text and text.lstrip()[:1] in ("{", "[", '"')


def _json_holds(data, value: str, depth: int) -> bool:
    """Whether a key or string of parsed JSON ``data`` holds ``value`` (:func:`holds`): the strings are
    checked joined, in one pass; only those that are escaped JSON themselves are looked into one by one."""
    texts = list(strings_of(data))
    joined = "\x00".join(texts)  # no form of a credential holds NUL, so none spans two strings
    if holds(joined, value, _MAX_NESTING):  # literal forms and base64 runs, no JSON parse
        return True
    return depth + 1 < _MAX_NESTING and any(holds(t, value, depth + 1) for t in texts if _escaped_json(t))


def holds(text: str, value: str, depth: int = 0) -> bool:
    """Whether ``text`` holds ``value`` in a form a reader could decode back to it: a literal form
    (:func:`forms`), a base64 run decoding to bytes that hold it, or — when ``text`` is JSON — a
    string of it that holds it (looked into up to 4 levels of JSON inside JSON strings)."""
    if not value or not text:
        return False
    if any(form in text for form in forms(value)):
        return True
    raw = value.encode("utf-8", "surrogatepass")
    if any(_base64_holds(m.group(0), raw) for m in _BASE64_RUN.finditer(text)):
        return True
    if depth < _MAX_NESTING and _escaped_json(text):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return False
        if isinstance(data, str):  # a bare JSON string: what it reads as
            return data != text and holds(data, value, depth + 1)
        return _json_holds(data, value, depth)
    return False


def _json_scrubbed(data, value: str, depth: int):
    if isinstance(data, str):
        return scrub(data, value, depth + 1)
    if isinstance(data, dict):
        return {_json_scrubbed(k, value, depth): _json_scrubbed(v, value, depth) for k, v in data.items()}
    if isinstance(data, list):
        return [_json_scrubbed(v, value, depth) for v in data]
    return data


def scrub(text: str, value: str, depth: int = 0) -> str:
    """``text`` with ``value`` replaced by ``[redacted]`` wherever :func:`holds` would find it: each
    literal form, each base64 run that decodes to it, and — for JSON — each string of it (the JSON is
    then written again, compact, non-ASCII as it is). JSON nested too deep to write again is
    withheld whole (``[redacted]``)."""
    if not value or not text:
        return text
    for form in forms(value):
        if form in text:
            text = text.replace(form, MASK)
    raw = value.encode("utf-8", "surrogatepass")
    text = _BASE64_RUN.sub(lambda m: MASK if _base64_holds(m.group(0), raw) else m.group(0), text)
    if depth < _MAX_NESTING and _escaped_json(text):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return text
        if isinstance(data, str):
            return text  # a bare JSON string: its literal forms are gone already
        if _json_holds(data, value, depth):
            try:
                return json.dumps(_json_scrubbed(data, value, depth), ensure_ascii=False)
            except RecursionError:  # nested too deep to write again: withheld whole
                return MASK
    return text


def holds_data(data, value: str) -> bool:
    """Whether parsed JSON ``data`` holds ``value`` in a key or string (:func:`holds`)."""
    return holds(data, value) if isinstance(data, str) else _json_holds(data, value, -1)


def scrub_data(data, value: str):
    """Parsed JSON ``data`` with ``value`` scrubbed (:func:`scrub`) out of every key and string."""
    return _json_scrubbed(data, value, -1)


def scrub_body(body: bytes, text: str, value: str) -> bytes | None:
    """The answer ``body`` without ``value``, as UTF-8, or None when neither ``body`` nor ``text`` (the
    body decoded with the answer's charset) holds it in any form (:func:`holds`). The caller marks a
    re-encoded body ``charset=utf-8``."""
    if not value:
        return None
    clean_text = scrub(text, value)
    if clean_text != text:
        return clean_text.encode("utf-8")
    forms_in_bytes = [f.encode("utf-8", "surrogatepass") for f in forms(value)]
    if not any(f in body for f in forms_in_bytes):
        return None
    for form in forms_in_bytes:  # bytes no decoding shows (a body that is not text)
        body = body.replace(form, MASK.encode())
    return body


def _values(tool: str) -> list[str]:
    try:
        return [v for v in (credentials.secret(tool), *credentials.secret_values(tool)) if v]
    except OSError:
        return []


def redact(tool: str, text):
    """``text`` with ``tool``'s credential (in every form :func:`scrub` finds) replaced by
    ``[redacted]``. Anything that is not a string is returned as it is; when the credential cannot be
    read, ``text`` is returned unchanged."""
    if not isinstance(text, str):
        return text
    for value in _values(tool):
        text = scrub(text, value)
    return text


def redact_data(tool: str, data):
    """Parsed JSON ``data`` (a model's parsed output, say) with ``tool``'s credential scrubbed out of
    every key and string; ``data`` itself when it holds none."""
    for value in _values(tool):
        if holds_data(data, value):
            data = scrub_data(data, value)
    return data


def every_credential() -> list[str]:
    """The credential of every tool the gateway knows (the parts it injects; the SMTP password), for
    keeping them out of what is sent: a model must never be handed one (spec §16.6)."""
    found: list[str] = []
    for tool in tools.TOOLS:
        found += [v for v in _values(tool) if v not in found]
    return found
