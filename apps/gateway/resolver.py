"""Name lookups within a call's deadline (ADR 0022).

``getaddrinfo`` takes no timeout: a resolver that does not answer holds the calling thread for
resolv.conf's timeout × attempts × servers, past any deadline the gateway promised. Here the lookup
runs on a small pool of the process's own (made again after a fork) and the caller waits for it at
most the time it has left; a lookup still running then finishes on its own thread, unwaited for.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout


class LookupTimedOut(TimeoutError):
    """The name was not resolved within the time left."""


class LookupFailed(OSError):
    """The name does not resolve (no such host, no address)."""


_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    pid = os.getpid()
    if _pool is None or _pool[0] != pid:  # a forked child must not use its parent's (dead) threads
        with _pool_lock:
            if _pool is None or _pool[0] != pid:
                _pool = (pid, ThreadPoolExecutor(max_workers=8, thread_name_prefix="gateway-lookup"))
    return _pool[1]


def addresses(host: str, port: int, timeout: float | None) -> list[str]:
    """The IP addresses of ``host`` to connect to (in the resolver's order, without repeats); a
    literal IP address is returned as it is, without a lookup. Waits at most ``timeout`` seconds
    (None: no bound). Raises :class:`LookupTimedOut` and :class:`LookupFailed`."""
    bare = host.strip("[]")
    try:
        ipaddress.ip_address(bare.partition("%")[0])
        return [bare]
    except ValueError:
        pass
    future = _executor().submit(socket.getaddrinfo, bare, port, 0, socket.SOCK_STREAM)
    try:
        infos = future.result(timeout=timeout)
    except FutureTimeout:
        raise LookupTimedOut(f"the name {bare} was not resolved within {timeout:.2f} s") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise LookupFailed(f"the name {bare} does not resolve ({exc})") from None
    found: list[str] = []
    for *_rest, sockaddr in infos:
        if sockaddr[0] not in found:
            found.append(sockaddr[0])
    if not found:
        raise LookupFailed(f"the name {bare} has no address")
    return found
