"""Writes of the notifications app: the sender's drain (what the Celery task runs) and marking a
person's notifications read. The rows themselves are written by the projection
(:mod:`.projections`), digests by :mod:`.digests`, deliveries by :mod:`.sending`."""

from __future__ import annotations

import time

from django.conf import settings
from django.utils import timezone

from apps.accounts.principal import Principal
from apps.notifications.digests import digests_build
from apps.notifications.models import Notification
from apps.notifications.sending import claim_due, send_claimed
from apps.tasks.store import worker_identity


def notifications_drain(*, batch: int | None = None, seconds: float | None = None) -> dict[str, int]:
    """Build the approvers' due digests, then claim and send due notifications batch after batch
    while batches come back full, for at most ``seconds`` (``FAULTDESK["NOTIFY_DRAIN_SECONDS"]``,
    shorter than the lease). Due rows include rows whose sender's lease expired (a sender that
    died): this is also the crash recovery that beat's tick runs. Returns ``{"digests": n,
    status: count, …}`` of what it did."""
    conf = settings.FAULTDESK
    batch = batch or conf["NOTIFY_BATCH"]
    deadline = time.monotonic() + (seconds if seconds is not None else conf["NOTIFY_DRAIN_SECONDS"])
    totals = {"digests": digests_build()}
    owner = worker_identity()
    while True:
        rows = claim_due(owner=owner, limit=batch)
        for status, n in send_claimed(rows).items():
            totals[status] = totals.get(status, 0) + n
        if len(rows) < batch or time.monotonic() >= deadline:
            return totals


def notifications_mark_read(*, principal: Principal, now=None) -> int:
    """Mark every unread page notification of ``principal`` in their tenant read. Returns how many
    were marked; one statement."""
    return (Notification.objects.visible_to(principal)
            .filter(recipient_id=principal.user_id, on_page=True, read_at__isnull=True)
            .update(read_at=now or timezone.now()))
