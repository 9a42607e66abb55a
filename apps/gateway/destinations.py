"""Where a tool may go: destinations as (scheme, host, port), parsed from URLs (ADR 0022)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

#: the port a scheme means when a URL names none
DEFAULT_PORTS = {"http": 80, "https": 443, "smtp": 25, "smtps": 465}


@dataclass(frozen=True)
class Destination:
    """One place a call may go: ``scheme`` (``http``, ``https``, ``smtp``, ``smtps``), ``host`` (lower
    case, an IPv6 address without brackets) and ``port``. Two destinations are the same only when all
    three are: another port on the same host is another destination."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@functools.lru_cache(maxsize=256)
def destination_of(url: str) -> Destination:
    """The destination of ``url`` (``https://h.example/v1`` → ``https://h.example:443``). Raises
    ``ValueError`` for a URL without a scheme or host, a port out of range, or a scheme with no known
    default port and none given."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if not scheme or not host:
        raise ValueError(f"not an absolute URL: {url!r}")
    port = parts.port  # raises ValueError when out of range
    if port is None:
        if scheme not in DEFAULT_PORTS:
            raise ValueError(f"{url!r} names no port and {scheme!r} has no default one")
        port = DEFAULT_PORTS[scheme]
    return Destination(scheme, host, port)


@functools.lru_cache(maxsize=256)
def destinations_of(urls: tuple[str, ...]) -> frozenset[Destination]:
    """The destinations of ``urls``, skipping empty entries. Raises ``ValueError`` as
    :func:`destination_of` does."""
    return frozenset(destination_of(u) for u in urls if u and u.strip())
