"""RabbitMQ as the Celery broker, for the runs that start their own processes (the end-to-end tests'
stacks, ``make chaos --broker amqp``).

Each run gets a virtual host of its own, so that two runs on one RabbitMQ never take each other's
messages and a run starts with empty queues: :func:`fresh_vhost` makes it (``rabbitmqctl``: the
machine's local RabbitMQ, as root or a user allowed to run it) and grants the run's user every
permission on it; :func:`drop_vhost` removes it with its queues. Where ``rabbitmqctl`` cannot be run,
the run falls back to the server's default virtual host and purges the product's queues instead
(two such runs at once would share them).

The server is ``FAULTDESK_RABBITMQ_URL`` (default ``amqp://guest:guest@127.0.0.1:5672``, the
local server's guest account, which RabbitMQ admits only from loopback).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from urllib.parse import quote, urlsplit

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672"
#: The queues the product's workers consume (config/settings/base.py CELERY_TASK_ROUTES).
QUEUES = ("agent", "tools", "outbox", "maintenance")


def server_url() -> str:
    """The RabbitMQ server's URL without a virtual host (``amqp://user:password@host:port``)."""
    return os.environ.get("FAULTDESK_RABBITMQ_URL", DEFAULT_URL).rstrip("/")


def available(timeout: float = 2.0) -> bool:
    """True when something accepts TCP connections at the server's host and port."""
    parts = urlsplit(server_url())
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=timeout):
            return True
    except OSError:
        return False


def _rabbitmqctl(*args: str) -> bool:
    """Run ``rabbitmqctl args``; True when it exited 0 (False when it is missing or refused)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return False
    try:
        done = subprocess.run([ctl, "-q", *args], capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def broker_url(vhost: str) -> str:
    """The Celery broker URL of ``vhost`` on the server (the name URL-quoted; ``/`` is the default
    virtual host)."""
    return f"{server_url()}/{quote(vhost, safe='')}"


def fresh_vhost(name: str) -> str:
    """Make the virtual host ``name`` anew (dropped first if it exists), give the server URL's user
    every permission on it, and return its broker URL. Without a usable ``rabbitmqctl``, purge the
    product's queues on the default virtual host and return its URL. Raises ``RuntimeError`` when
    no RabbitMQ answers at :func:`server_url`."""
    if not available():
        raise RuntimeError(f"no RabbitMQ answers at {urlsplit(server_url()).netloc.rpartition('@')[2]} "
                           "(FAULTDESK_RABBITMQ_URL)")
    user = urlsplit(server_url()).username or "guest"
    _rabbitmqctl("delete_vhost", name)
    if _rabbitmqctl("add_vhost", name) and _rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*"):
        return broker_url(name)
    url = broker_url("/")
    purge(url)
    return url


def purge(url: str) -> None:
    """Empty the product's queues on the broker at ``url`` (a queue that does not exist is skipped)."""
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn:
        for queue in QUEUES:
            channel = conn.channel()
            try:
                channel.queue_purge(queue)
            except Exception:  # noqa: BLE001, S110 - a queue never declared has nothing to purge
                pass
            finally:
                try:
                    channel.close()
                except Exception:  # noqa: BLE001, S110 - the server closed it after a missing queue
                    pass


def drop_vhost(url: str) -> None:
    """Remove the virtual host of the broker URL ``url`` with its queues; the default virtual host is
    purged instead. Never raises."""
    vhost = urlsplit(url).path.lstrip("/")
    try:
        if vhost and vhost != "%2F":
            _rabbitmqctl("delete_vhost", vhost)
        else:
            purge(url)
    except Exception:  # noqa: BLE001, S110 - clean-up after a run must not fail it
        pass
