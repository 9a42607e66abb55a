"""Celery task of the attachments' outbox (addressed by name, :mod:`apps.core.queue`): kicked on
the commit of a receipt that carries attachments, and ticked by beat for rows a crash left."""

from __future__ import annotations

from celery import shared_task

from apps.core import queue


@shared_task(name=queue.DELIVER_ATTACHMENTS)
def deliver_attachments() -> int:
    import os
    import socket

    from apps.attachments.delivery import deliveries_drain

    return deliveries_drain(owner=f"{socket.gethostname()}:{os.getpid()}")
