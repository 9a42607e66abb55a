"""Device inventory and state with object versions (DESIGN.md §3 ``devices``).

``version`` is the object version V_o: it increases by one on every state change, and an
approval is bound to the version it was based on (DESIGN.md §7).
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class DeviceState(models.TextChoices):
    OK = "ok", _("OK")
    DEGRADED = "degraded", _("Degraded")
    FAULT = "fault", _("Fault")
    OFFLINE = "offline", _("Offline")


class Criticality(models.TextChoices):
    LOW = "low", _("Low")
    MEDIUM = "medium", _("Medium")
    HIGH = "high", _("High")


class Device(models.Model):
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="devices")
    asset_tag = models.CharField(max_length=64)
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=64, help_text="device family, e.g. printer, ups, switch")
    model = models.CharField(max_length=120, blank=True)
    site = models.CharField(max_length=120, blank=True)
    criticality = models.CharField(max_length=8, choices=Criticality.choices, default=Criticality.MEDIUM)
    state = models.CharField(max_length=16, choices=DeviceState.choices, default=DeviceState.OK)
    alert_code = models.CharField(max_length=64, blank=True)
    alert_message = models.CharField(max_length=300, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    version = models.PositiveIntegerField(default=1)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("device")
        verbose_name_plural = _("devices")
        constraints = [models.UniqueConstraint(fields=["tenant", "asset_tag"], name="device_tenant_asset_uniq")]
        ordering = ["tenant", "asset_tag"]

    def __str__(self) -> str:
        return f"{self.asset_tag} ({self.kind}, v{self.version})"
