"""Writes to device state. Every change bumps the object version V_o by exactly one."""

from __future__ import annotations

from django.db import transaction
from django.db.models import F

from apps.devices.models import Device

_MUTABLE = {"state", "alert_code", "alert_message", "metrics", "criticality", "site", "name", "model"}


def device_update_state(*, device: Device, **changes) -> Device:
    """Apply ``changes`` (fields of :data:`_MUTABLE`) and increase ``version`` by one, atomically.

    Raises ``ValueError`` for an unknown field. Returns the refreshed device.
    """
    unknown = set(changes) - _MUTABLE
    if unknown:
        raise ValueError(f"cannot change device fields: {sorted(unknown)}")
    with transaction.atomic():
        Device.objects.filter(pk=device.pk).update(version=F("version") + 1, **changes)
    device.refresh_from_db()
    return device
