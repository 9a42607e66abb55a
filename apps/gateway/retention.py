"""Retention of the outbound call records (DESIGN.md §13 "Retention"; ADR 0022): a record is deleted
once it is older than the tenant's ``gateway_calls_days`` (records of no tenant: the installation's
default). They hold no payload; they go because they are operational rows that only grow."""

from __future__ import annotations

from datetime import datetime

from apps.core.retention import Purged, delete_batch
from apps.gateway.models import GatewayCall


def purgeable_calls(tenant_id: int | None, *, before: datetime):
    """Call records of ``tenant_id`` (``None``: of no tenant) made before ``before``."""
    rows = GatewayCall.objects.filter(tenant__isnull=True) if tenant_id is None \
        else GatewayCall.objects.for_tenant(tenant_id)
    return rows.filter(at__lt=before)


def purge_calls_batch(tenant_id: int | None, *, before: datetime, limit: int) -> Purged:
    """Delete up to ``limit`` of :func:`purgeable_calls` (one short transaction)."""
    return delete_batch(purgeable_calls(tenant_id, before=before), limit)
