from django.contrib import admin
from django.db.models import Q

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.accounts.roles import admin_scopes
from apps.evidence.models import Chunk, Document, DocumentVersion


class ScopedKnowledgeAdmin(ReadOnlyTenantAdmin):
    """Knowledge rows are shown only in the scopes the admin may read in their tenant
    (DESIGN.md §9): the Django admin is no way around a retrieval filter. ``scope_path`` is the
    ORM path to the row's access scope."""

    scope_path = "scope"

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        scopes = admin_scopes(request.user)
        if scopes is None:
            return qs
        readable = Q(pk__in=[])
        for tenant_id, names in scopes.items():
            readable |= Q(**{self.tenant_path: tenant_id, f"{self.scope_path}__in": names})
        return qs.filter(readable)


@admin.register(Document)
class DocumentAdmin(ScopedKnowledgeAdmin):
    list_display = ("title", "tenant", "scope", "current_version", "retired", "source")
    list_filter = ("tenant", "scope", "retired")
    search_fields = ("title", "source")


@admin.register(DocumentVersion)
class DocumentVersionAdmin(ScopedKnowledgeAdmin):
    tenant_path = "document__tenant_id"
    scope_path = "document__scope"
    list_display = ("document", "version", "content_digest", "ingested_at")
    search_fields = ("document__title",)


@admin.register(Chunk)
class ChunkAdmin(ScopedKnowledgeAdmin):
    list_display = ("id", "document_version", "section", "scope", "is_current")
    list_filter = ("scope", "is_current")
    search_fields = ("text", "section")
    exclude = ("embedding", "search_vector")
