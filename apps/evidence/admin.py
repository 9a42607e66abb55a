from django.contrib import admin

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.evidence.models import Chunk, Document, DocumentVersion


@admin.register(Document)
class DocumentAdmin(ReadOnlyTenantAdmin):
    list_display = ("title", "tenant", "scope", "current_version", "retired", "source")
    list_filter = ("tenant", "scope", "retired")
    search_fields = ("title", "source")


@admin.register(DocumentVersion)
class DocumentVersionAdmin(ReadOnlyTenantAdmin):
    tenant_path = "document__tenant_id"
    list_display = ("document", "version", "content_digest", "ingested_at")
    search_fields = ("document__title",)


@admin.register(Chunk)
class ChunkAdmin(ReadOnlyTenantAdmin):
    list_display = ("id", "document_version", "section", "scope", "is_current")
    list_filter = ("scope", "is_current")
    search_fields = ("text", "section")
    exclude = ("embedding", "search_vector")
