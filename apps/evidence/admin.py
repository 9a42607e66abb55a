from django.contrib import admin
from django.db.models import Q

from apps.accounts.admin_base import ReadOnlyTenantAdmin
from apps.accounts.roles import admin_scopes
from apps.evidence.models import Chunk, Document, DocumentVersion, TermFrequency, TermStatistics


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


@admin.register(TermStatistics)
class TermStatisticsAdmin(ReadOnlyTenantAdmin):
    """When each tenant's full-text word counts were last taken (read-only: the beat job
    ``refresh_term_statistics`` writes them)."""

    list_display = ("tenant", "refreshed_at", "current_chunks", "last_chunk_id")


@admin.register(TermFrequency)
class TermFrequencyAdmin(ScopedKnowledgeAdmin):
    """How many current chunks of a scope hold each common word; the row with an empty word is
    the scope's chunk count. Shown only in the scopes the admin may read."""

    list_display = ("lexeme", "tenant", "scope", "chunks")
    list_filter = ("tenant", "scope")
    search_fields = ("lexeme",)
