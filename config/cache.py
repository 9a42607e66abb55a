"""The coordination cache of the settings (``CACHES["coordination"]``): where the processes share their
hints to run (apps/core/queue.py)."""

from __future__ import annotations


def coordination_cache(redis_url: str) -> dict:
    """The ``CACHES`` entry of the hints processes share (apps/core/queue.py: a dispatcher kick
    already waiting), given the Redis URL of the deployment (``REDIS_URL``; with RabbitMQ as the
    broker Redis still holds these hints when it is there): ``redis://``, ``rediss://``, or kombu's
    ``redis+socket://PATH?virtual_host=N``. With no Redis (an empty or non-Redis URL) there is no
    shared store, and a cache of each process's own would be wrong (the flag one process sets is
    cleared in another), so it is Django's dummy cache, whose ``add`` always succeeds: every commit
    sends. Never ``clear()`` this cache: on a Redis broker that flushes the broker's database."""
    from urllib.parse import parse_qs, urlsplit

    if redis_url.startswith(("redis://", "rediss://")):
        return {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    if redis_url.startswith("redis+socket://"):
        parts = urlsplit(redis_url)
        db = (parse_qs(parts.query).get("virtual_host") or ["0"])[0]
        return {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": f"unix://{parts.path}?db={db}"}
    return {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}
