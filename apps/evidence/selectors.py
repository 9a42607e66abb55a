"""Permission-aware hybrid retrieval (DESIGN.md §9; spec §16.6: permissions applied before the
content is fetched, in the ranking query).

Both rankings — pgvector cosine distance over the HNSW index and PostgreSQL full-text — run with
the tenant and the principal's scopes in their WHERE clause, and are fused by reciprocal rank
fusion (RRF, k=60).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from django.db import connection, transaction

from apps.evidence.embedding import embed_query
from apps.evidence.models import Chunk

RRF_K = 60
CANDIDATES = 50


@dataclass(frozen=True)
class EvidenceRef:
    """A citation-ready reference to one chunk version (spec table 16.2 "证据引用").

    ``score`` is the fused RRF score; ``vector_rank``/``text_rank`` are 1-based ranks in each list
    (None when absent from it).
    """

    chunk_id: int
    document_id: int
    document_title: str
    source: str
    version: int
    section: str
    start: int
    end: int
    scope: str
    content_digest: str
    score: float
    vector_rank: int | None
    text_rank: int | None
    excerpt: str

    def as_dict(self) -> dict:
        return asdict(self)


_HYBRID_SQL = """
WITH vec AS (
    SELECT c.id, row_number() OVER (ORDER BY c.embedding <=> %(qvec)s::vector) AS rnk
    FROM evidence_chunk c
    WHERE c.tenant_id = %(tenant)s AND c.scope = ANY(%(scopes)s) AND c.is_current
    ORDER BY c.embedding <=> %(qvec)s::vector
    LIMIT %(cand)s
), q AS (
    SELECT to_tsquery('english', replace(plainto_tsquery('english', %(qtext)s)::text, '&', '|')) AS tsq
), txt AS (
    SELECT c.id, row_number() OVER (ORDER BY ts_rank_cd(c.search_vector, q.tsq) DESC, c.id) AS rnk
    FROM evidence_chunk c, q
    WHERE c.tenant_id = %(tenant)s AND c.scope = ANY(%(scopes)s) AND c.is_current
      AND c.search_vector @@ q.tsq
    ORDER BY ts_rank_cd(c.search_vector, q.tsq) DESC, c.id
    LIMIT %(cand)s
)
SELECT id, SUM(1.0 / (%(rrf)s + rnk)) AS score,
       MIN(CASE WHEN src = 'v' THEN rnk END) AS vrank,
       MIN(CASE WHEN src = 't' THEN rnk END) AS trank
FROM (SELECT id, rnk, 'v' AS src FROM vec UNION ALL SELECT id, rnk, 't' AS src FROM txt) u
GROUP BY id
ORDER BY score DESC, id
LIMIT %(k)s
"""


def evidence_retrieve(
    *, tenant_id: int, scopes: list[str] | tuple[str, ...], query: str, k: int = 5
) -> list[EvidenceRef]:
    """Top-``k`` current chunks of ``tenant_id`` readable with ``scopes`` for ``query``.

    Returns at most ``k`` :class:`EvidenceRef`, best first. An empty ``scopes`` returns nothing.
    """
    if not scopes or not query.strip():
        return []
    qvec = "[" + ",".join(f"{x:.7f}" for x in embed_query(query)) + "]"
    with transaction.atomic(), connection.cursor() as cur:
        # Filtered HNSW scans stop after ef_search candidates; widen it so a scope filter still
        # yields k rows for this corpus size (issue 6 replaces this with a complete strategy).
        cur.execute("SET LOCAL hnsw.ef_search = 400")
        cur.execute(
            _HYBRID_SQL,
            {"qvec": qvec, "tenant": tenant_id, "scopes": list(scopes), "qtext": query, "cand": CANDIDATES,
             "rrf": RRF_K, "k": k},
        )
        rows = cur.fetchall()
    chunks = {
        c.pk: c
        for c in Chunk.objects.for_tenant(tenant_id).select_related("document_version__document")
        .filter(pk__in=[r[0] for r in rows])
    }
    refs = []
    for chunk_id, score, vrank, trank in rows:
        c = chunks[chunk_id]
        doc = c.document_version.document
        refs.append(
            EvidenceRef(
                chunk_id=c.pk,
                document_id=doc.pk,
                document_title=doc.title,
                source=doc.source,
                version=c.document_version.version,
                section=c.section,
                start=c.start_offset,
                end=c.end_offset,
                scope=c.scope,
                content_digest=c.content_digest,
                score=round(float(score), 6),
                vector_rank=vrank,
                text_rank=trank,
                excerpt=c.text[:400],
            )
        )
    return refs


def chunk_readable(*, chunk_id: int, tenant_id: int, scopes: list[str] | tuple[str, ...]) -> Chunk | None:
    """The chunk if the viewer (tenant + scopes) may read it *now*, else None (re-check on read)."""
    return (
        Chunk.objects.for_tenant(tenant_id).select_related("document_version__document")
        .filter(pk=chunk_id, scope__in=list(scopes))
        .first()
    )
