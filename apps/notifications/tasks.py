"""Celery task of the notifications app: the sender (kicked on commit by the projection, ticked by
beat, which makes it the recovery of rows whose sender died). Thin: it calls the service.
Addressed by name (:mod:`apps.core.queue`), on the ``outbox`` queue."""

from __future__ import annotations

from celery import shared_task

from apps.core import queue


@shared_task(name=queue.NOTIFY_SEND)
def send_notifications() -> dict:
    from apps.notifications.services import notifications_drain

    queue.kick_received(queue.NOTIFY_SEND)  # before the first claim: a later commit kicks again
    return notifications_drain()
