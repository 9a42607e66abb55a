"""Mirror of tickets in external systems (external id + version), DESIGN.md §3 ``tickets``."""

from __future__ import annotations

from django.db import models


class TicketMirror(models.Model):
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.PROTECT, related_name="tickets")
    action = models.OneToOneField("actions.Action", on_delete=models.PROTECT, related_name="ticket")
    connector = models.CharField(max_length=32)
    external_id = models.CharField(max_length=100)
    external_version = models.PositiveIntegerField()
    status = models.CharField(max_length=32)
    data = models.JSONField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["connector", "external_id"], name="ticket_connector_external_uniq"),
        ]
        ordering = ["-updated_at"]

    def __str__(self) -> str:
        return f"{self.connector}:{self.external_id} v{self.external_version}"
