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

import json
from urllib.parse import quote

from apps.core.jsonwalk import strings_of
from apps.gateway import credentials

MASK = "[redacted]"
#: a line of a several-line credential shorter than this is not masked on its own (it would mask
#: common words: a credential's lines are keys, each long)
_MIN_LINE = 8


def forms(value: str) -> list[str]:
    """Every spelling of the credential ``value`` a text could hold and decode back to it, longest
    first (so a longer form is masked before a form it contains): the value, its JSON string escapes
    (with and without ``\\/`` and ``\\uXXXX`` for non-ASCII), its ``repr`` escapes, its
    percent-encodings, and each of its lines (stripped) of 8 characters or more. Empty for an empty
    value."""
    if not value:
        return []
    found = {value, repr(value)[1:-1], json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1],
             quote(value, safe=""), quote(value)}
    found |= {f.replace("/", "\\/") for f in list(found)}
    if "\n" in value or "\r" in value:
        for line in value.splitlines():
            line = line.strip()
            if len(line) >= _MIN_LINE:
                found |= set(forms(line))
    return sorted(found, key=len, reverse=True)


def scrub(text: str, value: str) -> str:
    """``text`` with every form (:func:`forms`) of ``value`` replaced by ``[redacted]``."""
    for form in forms(value):
        if form in text:
            text = text.replace(form, MASK)
    return text


def _unescaped_json_holds(text: str, value: str) -> bool:
    """Whether a JSON ``text`` holds ``value`` in one of its strings once decoded (``\\uXXXX``
    escapes of plain letters, say); False when ``text`` is not JSON."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return any(value in text for text in strings_of(data))


def _json_scrubbed(data, value: str):
    if isinstance(data, str):
        return scrub(data, value)
    if isinstance(data, dict):
        return {_json_scrubbed(k, value): _json_scrubbed(v, value) for k, v in data.items()}
    if isinstance(data, list):
        return [_json_scrubbed(v, value) for v in data]
    return data


def scrub_body(body: bytes, text: str, value: str) -> bytes | None:
    """The answer ``body`` without ``value``, as UTF-8, or None when neither ``body`` nor ``text`` (the
    body decoded with the answer's charset) holds it in any form. A JSON body is re-encoded from its
    scrubbed data (so an escaped echo is caught); any other text is re-encoded scrubbed. The caller
    marks a re-encoded body ``charset=utf-8``."""
    if not value:
        return None
    clean_text = scrub(text, value)
    in_bytes = any(form.encode("utf-8", "surrogatepass") in body for form in forms(value))
    in_json = _unescaped_json_holds(text, value)
    if not (in_bytes or in_json or clean_text != text):
        return None
    if in_json:
        try:
            return json.dumps(_json_scrubbed(json.loads(text), value), ensure_ascii=False).encode("utf-8")
        except RecursionError:  # nested too deep to rebuild: the whole answer is withheld
            return MASK.encode()
    if clean_text != text:
        return clean_text.encode("utf-8")
    for form in forms(value):  # bytes no decoding shows (a body that is not text)
        body = body.replace(form.encode("utf-8", "surrogatepass"), MASK.encode())
    return body


def redact(tool: str, text):
    """``text`` with ``tool``'s credential (in every form, :func:`forms`) replaced by ``[redacted]``.
    Anything that is not a string is returned as it is; when the credential cannot be read, ``text``
    is returned unchanged."""
    if not isinstance(text, str):
        return text
    try:
        values = [credentials.secret(tool), *credentials.secret_values(tool)]
    except OSError:
        return text
    for value in values:
        text = scrub(text, value)
    return text
