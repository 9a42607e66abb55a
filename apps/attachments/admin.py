from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.attachments.models import Attachment, AttachmentDelivery


@admin.register(Attachment)
class AttachmentAdmin(ReadOnlyTenantAdmin):
    """The files of fault reports (read-only: a file is part of its task's record)."""

    list_display = ("name", "tenant", "task", "kind", "content_type", "size", "sha256", "created_at")
    list_filter = ("kind",)
    search_fields = ("name", "sha256")


@admin.register(AttachmentDelivery)
class AttachmentDeliveryAdmin(ReadOnlyTenantAdmin):
    """Sending each file to its ticket (the attachments' outbox)."""

    list_display = ("attachment", "tenant", "connector", "ticket_id", "status", "attempts", "last_error",
                    "delivered_at")
    list_filter = ("status", "connector")
