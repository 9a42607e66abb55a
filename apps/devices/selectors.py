"""Reads of device inventory, always scoped to a tenant."""

from __future__ import annotations

from django.db.models import QuerySet

from apps.accounts.principal import Principal
from apps.core import sql
from apps.devices.models import Device


def device_list(*, principal: Principal) -> QuerySet[Device]:
    """Devices of the principal's tenant, ordered by asset tag."""
    return Device.objects.visible_to(principal).order_by("asset_tag")


def device_get(*, tenant_id: int, device_id: int) -> Device | None:
    """One device of ``tenant_id`` or None (a device of another tenant is None too). Read on every
    report (its submit and its device read), so by SQL written once (:mod:`apps.core.sql`)."""
    try:
        device_id = int(device_id)
    except (TypeError, ValueError):
        return None
    if not 0 < device_id < 2**63:  # what the ORM's lookup matches nothing for, too
        return None
    return sql.row(Device, "t0.id = %s", [device_id], tenant_id=tenant_id)


def device_read(*, tenant_id: int, device_id: int) -> dict | None:
    """The read-only device-state tool (DESIGN.md §1 step 2): state plus object version.

    Returns ``{"device_id", "asset_tag", "name", "kind", "site", "criticality", "state",
    "alert_code", "alert_message", "metrics", "version"}`` or None when the device does not exist
    in the tenant. The caller records the result as an event before using it.
    """
    device = device_get(tenant_id=tenant_id, device_id=device_id)
    if device is None:
        return None
    return {
        "device_id": device.pk,
        "asset_tag": device.asset_tag,
        "name": device.name,
        "kind": device.kind,
        "site": device.site,
        "criticality": device.criticality,
        "state": device.state,
        "alert_code": device.alert_code,
        "alert_message": device.alert_message,
        "metrics": device.metrics,
        "version": device.version,
    }
