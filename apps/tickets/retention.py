"""Retention of inbound webhooks (DESIGN.md §13 "Retention").

A verified delivery's row is also the deduplication record of its ``event_id``: it is kept for the
idempotency window (a ticket system retries a delivery for far less, and a late duplicate that
arrives after that is still applied only by the ticket's version). Unverified rows (bodies from
callers that failed the signature, cut to 1,000 characters) carry nothing anyone relies on and go
at the tenant's cut-off. A row tied to an unreconciled action is kept. Rows with no tenant (an
unverified body names none) are purged under the default policy.
"""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q

from apps.core.retention import Purged, delete_batch
from apps.tickets.models import InboundWebhook


def purgeable_webhooks(tenant_id: int | None, *, before: datetime, keys_before: datetime):
    """Webhook rows of ``tenant_id`` (``None``: rows with no tenant) that may be deleted."""
    rows = (InboundWebhook.objects.filter(tenant__isnull=True) if tenant_id is None
            else InboundWebhook.objects.for_tenant(tenant_id))
    kept_for_dedup = Q(verified=True) & Q(received_at__gte=keys_before)
    return (rows.filter(received_at__lt=before).exclude(kept_for_dedup)
            .exclude(action__status__in=("INTENDED", "UNKNOWN")))


def purge_webhooks_batch(tenant_id: int | None, *, before: datetime, keys_before: datetime, limit: int) -> Purged:
    """Delete up to ``limit`` of :func:`purgeable_webhooks` that nothing holds."""
    return delete_batch(purgeable_webhooks(tenant_id, before=before, keys_before=keys_before), limit)
