"""Undoing an answer's ``Content-Encoding`` without ever holding more than the tool's cap (ADR 0022).

The gateway asks for ``Accept-Encoding: identity``; a server may compress anyway. A compressed
answer is inflated here a bounded step at a time — each layer of a nested encoding
(``gzip, gzip``) yields at most ``cap + 1`` bytes in all, and each step of it at most the bytes still
allowed — so a small answer that inflates to gigabytes (a "zip bomb") is cut at the cap, never
decoded whole in memory. An encoding other than ``gzip``/``x-gzip``/``deflate``/``identity`` is not
decoded: :class:`UnsupportedEncoding`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator


class TooLarge(Exception):  # noqa: N818 - the name says what happened
    """A layer of the answer decoded past the cap."""


class UnsupportedEncoding(Exception):  # noqa: N818 - the name says what happened
    """The answer's ``Content-Encoding`` names an encoding the gateway does not decode (``br``,
    ``zstd``, ``compress``, …); the answer is not read."""


_GZIP = ("gzip", "x-gzip")
_DEFLATE = ("deflate",)


def encodings_of(header: str) -> list[str]:
    """The encodings of a ``Content-Encoding`` header value, in the order they were applied
    (``identity`` dropped, lower case). Raises :class:`UnsupportedEncoding` for any other than
    ``gzip``, ``x-gzip`` and ``deflate``."""
    found = [e.strip().lower() for e in (header or "").split(",") if e.strip()]
    found = [e for e in found if e != "identity"]
    for e in found:
        if e not in _GZIP + _DEFLATE:
            raise UnsupportedEncoding(f"the answer is encoded with {e!r}, which the gateway does not decode")
    return found


def _new_inflater(encoding: str, head: bytes):
    if encoding in _GZIP:
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    # deflate: a zlib stream as the RFC says, or the raw deflate some servers send
    zlib_header = len(head) >= 2 and head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0
    return zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)


def _inflate(chunks: Iterable[bytes], encoding: str, cap: int) -> Iterator[bytes]:
    """The bytes of ``chunks`` with one layer of ``encoding`` undone, at most ``cap`` of them. A gzip
    body of several members (RFC 1952 §2.2) is read member after member; bytes after the end of a
    deflate stream are ignored. Raises :class:`TooLarge` past the cap, ``zlib.error`` on a corrupt
    stream."""
    total = 0
    inflater = None
    finished = False  # a deflate stream ended: whatever follows is ignored
    for chunk in chunks:
        data = chunk
        while data and not finished:
            if inflater is None:
                inflater = _new_inflater(encoding, data)
            out = inflater.decompress(data, cap + 1 - total)  # never 0 (unbounded): total <= cap here
            total += len(out)
            if total > cap:
                raise TooLarge(f"the answer decodes to more than {cap} bytes")
            if out:
                yield out
            if inflater.eof:
                data = inflater.unused_data
                if encoding in _GZIP:
                    inflater = None  # the next member, if any
                else:
                    finished = True
            else:
                data = inflater.unconsumed_tail
    if inflater is not None and not inflater.eof:
        rest = inflater.flush()
        total += len(rest)
        if total > cap:
            raise TooLarge(f"the answer decodes to more than {cap} bytes")
        if rest:
            yield rest


def decoded(chunks: Iterable[bytes], content_encoding: str, cap: int) -> Iterator[bytes]:
    """The answer's bytes (``chunks`` as they came off the wire) with its ``Content-Encoding`` undone,
    layer by layer, each layer bounded by ``cap`` (bytes). Raises :class:`UnsupportedEncoding`,
    :class:`TooLarge`, and ``zlib.error`` for a stream that does not decode."""
    stream: Iterable[bytes] = chunks
    for encoding in reversed(encodings_of(content_encoding)):
        stream = _inflate(stream, encoding, cap)
    return iter(stream)
