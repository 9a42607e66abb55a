"""Documents, versions, chunks and embeddings (DESIGN.md §9; spec §16.2 table 16.2 "evidence
reference": source, version, location, access scope, content digest)."""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVectorField
from django.db import models
from django.utils.translation import gettext_lazy as _
from pgvector.django import HnswIndex, VectorField

from apps.accounts.models import AccessScope
from apps.accounts.scoping import TenantScopedManager, scoped_manager

EMBEDDING_DIMENSIONS = 512  # apps.evidence.embedding.DIMENSIONS; shorter embeddings are zero-padded


class Document(models.Model):
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="documents")
    source = models.CharField(max_length=500, help_text="where the document came from (relative path)")
    title = models.CharField(max_length=300)
    scope = models.CharField(max_length=32, choices=AccessScope.choices, default=AccessScope.PUBLIC)
    current_version = models.PositiveIntegerField(default=0)
    retired = models.BooleanField(default=False)
    # Governance metadata of the current version (apps.evidence.governance; the seed projection's fields).
    doc_id = models.CharField(max_length=200, blank=True)
    locale = models.CharField(max_length=16, default="en")
    owner = models.CharField(max_length=200, blank=True)
    governance_status = models.CharField(max_length=32, default="APPROVED")
    publication_status = models.CharField(max_length=32, default="PUBLISHED")
    freshness_status = models.CharField(max_length=32, default="CURRENT")
    effective_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_verified_at = models.DateTimeField(null=True, blank=True)
    review_due_at = models.DateTimeField(null=True, blank=True)
    safety_class = models.CharField(max_length=64, blank=True)
    requires_human_gate = models.BooleanField(default=False)
    device_kinds = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    alert_codes = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    #: every metadata field as ingested (apps.evidence.governance.metadata_normalise)
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("document")
        verbose_name_plural = _("documents")
        constraints = [models.UniqueConstraint(fields=["tenant", "source"], name="document_tenant_source_uniq")]
        ordering = ["tenant", "source"]

    def __str__(self) -> str:
        return f"{self.title} (v{self.current_version}, {self.scope})"


class DocumentVersion(models.Model):
    document = models.ForeignKey(Document, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    content_digest = models.CharField(max_length=64)
    content = models.TextField()
    #: the governance metadata this version was ingested with (part of its digest)
    metadata = models.JSONField(default=dict, blank=True)
    ingested_at = models.DateTimeField(auto_now_add=True)

    objects = scoped_manager("document__tenant_id")

    class Meta:
        verbose_name = _("document version")
        verbose_name_plural = _("document versions")
        constraints = [
            models.UniqueConstraint(fields=["document", "version"], name="docversion_doc_version_uniq"),
        ]
        ordering = ["document", "version"]

    def __str__(self) -> str:
        return f"{self.document.source} v{self.version}"


class Chunk(models.Model):
    """A retrievable piece of one document version, with its location.

    ``tenant`` and ``scope`` are copied from the document so the ranking query filters on the
    chunk row itself (permissions applied in SQL before ranking, DESIGN.md §9). So are the
    governance fields retrieval filters on (``governed``: approved and published; the dates in
    force) and what the document applies to (``locale``, ``device_kinds``, ``alert_codes``).
    """

    document_version = models.ForeignKey(DocumentVersion, on_delete=models.CASCADE, related_name="chunks")
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="+")
    scope = models.CharField(max_length=32, choices=AccessScope.choices)
    is_current = models.BooleanField(default=True)
    ordinal = models.PositiveIntegerField()
    section = models.CharField(max_length=300, blank=True)
    start_offset = models.PositiveIntegerField()
    end_offset = models.PositiveIntegerField()
    text = models.TextField()
    content_digest = models.CharField(max_length=64)
    #: None while the chunk awaits (re-)embedding (``manage.py reembed``)
    embedding = VectorField(dimensions=EMBEDDING_DIMENSIONS, null=True)
    #: the model that made ``embedding`` (apps.evidence.embedding); queries compare like with like
    embedding_model = models.CharField(max_length=200, default="use-multilingual-v3")
    search_vector = SearchVectorField(null=True)
    locale = models.CharField(max_length=16, default="en")
    governed = models.BooleanField(default=True, help_text="approved and published")
    effective_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    device_kinds = ArrayField(models.CharField(max_length=64), default=list, blank=True)
    alert_codes = ArrayField(models.CharField(max_length=64), default=list, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("chunk")
        verbose_name_plural = _("chunks")
        ordering = ["document_version", "ordinal"]
        indexes = [
            HnswIndex(
                name="chunk_embedding_hnsw",
                fields=["embedding"],
                # ef_construction=128: recall@10 0.984 at ef_search 300 on the bench's 100k chunks,
                # against 0.902 at 64 and ef_search 200 (docs/performance.md)
                m=16,
                ef_construction=128,
                opclasses=["vector_cosine_ops"],
            ),
            GinIndex(fields=["search_vector"], name="chunk_search_vector_gin"),
            models.Index(fields=["tenant", "scope", "is_current"], name="chunk_tenant_scope_idx"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["document_version", "ordinal"], name="chunk_version_ordinal_uniq"),
        ]

    def __str__(self) -> str:
        return f"chunk {self.pk} of {self.document_version} §{self.section}"


class TermStatistics(models.Model):
    """When a tenant's term frequencies (:class:`TermFrequency`) were last counted, and what its
    current chunks looked like then (their number and the highest id), so the beat job recounts
    only a tenant whose chunks changed (apps.evidence.termstats)."""

    tenant = models.OneToOneField("accounts.Tenant", on_delete=models.CASCADE, related_name="+")
    refreshed_at = models.DateTimeField()
    current_chunks = models.PositiveIntegerField()
    last_chunk_id = models.BigIntegerField()

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("term statistics")
        verbose_name_plural = _("term statistics")

    def __str__(self) -> str:
        return f"term statistics of tenant {self.tenant_id} at {self.refreshed_at:%Y-%m-%d %H:%M}"


class TermFrequency(models.Model):
    """Document frequency of one full-text lexeme: how many current chunks of ``tenant`` in
    ``scope`` contain it (``lexeme`` as stored in ``Chunk.search_vector``: an English stem or a
    Chinese word). The row with ``lexeme=""`` holds the scope's number of current chunks. Only
    lexemes in at least ``termstats.MIN_STORED`` chunks are kept; a missing one is rare. Counted
    per scope, so a reader's figures are sums over the scopes they may read and never depend on
    chunks they may not (apps.evidence.termstats)."""

    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="+")
    scope = models.CharField(max_length=32)
    lexeme = models.CharField(max_length=255, blank=True)
    chunks = models.PositiveIntegerField()

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("term frequency")
        verbose_name_plural = _("term frequencies")
        constraints = [
            models.UniqueConstraint(fields=["tenant", "scope", "lexeme"], name="termfrequency_uniq"),
        ]

    def __str__(self) -> str:
        return f"{self.lexeme or '(chunks)'} in {self.chunks} chunks ({self.scope})"
