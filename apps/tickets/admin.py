from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin, TenantScopedAdmin
from apps.tickets.models import InboundWebhook, SlaPolicy, TicketMirror


@admin.register(TicketMirror)
class TicketMirrorAdmin(ReadOnlyTenantAdmin):
    list_display = ("external_id", "connector", "external_version", "status", "tenant", "updated_at")
    list_filter = ("connector", "status")


@admin.register(InboundWebhook)
class InboundWebhookAdmin(ReadOnlyTenantAdmin):
    """Deliveries that correlate to no tenant (forged, malformed, uncorrelated) are visible to a
    platform superuser only."""

    list_display = ("received_at", "source", "event_id", "outcome", "verified", "reason", "tenant")
    list_filter = ("source", "outcome", "verified")


@admin.register(SlaPolicy)
class SlaPolicyAdmin(TenantScopedAdmin):
    """A tenant's service levels: business hours, holidays and targets by priority
    (apps/tickets/sla.py). One per tenant; a tenant admin edits their own tenant's."""

    list_display = ("tenant", "timezone", "workdays", "day_start", "day_end", "updated_at")
