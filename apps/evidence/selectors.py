"""Permission-aware hybrid retrieval (DESIGN.md §9; spec §16.6: permissions applied before the
content is fetched, in the ranking query).

Both rankings — pgvector cosine distance and PostgreSQL full-text — run with the tenant and the
principal's scopes in their WHERE clause, and are fused by reciprocal rank fusion (RRF, k=60).
The vector ranking is complete under any filter (:func:`vector_candidates`): rare permitted chunks
are ranked exactly, and an HNSW answer cut short by the filter is redone exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from apps.core import sql
from apps.evidence import parallel, termstats
from apps.evidence.embedding import embed_query, model_configured
from apps.evidence.models import Chunk
from apps.evidence.termstats import counted_chunks, match_query
from apps.evidence.textsearch import cjk_tsquery, segmented

RRF_K = 60
CANDIDATES = 50


@dataclass(frozen=True)
class EvidenceRef:
    """A citation-ready reference to one chunk version (spec table 16.2 "证据引用").

    ``score`` is the fused RRF score (:func:`evidence_rank`) or the raw cosine similarity to the
    report (:func:`apps.evidence.relevance.evidence_select`); ``vector_rank``/``text_rank`` are
    1-based ranks in each list (None when absent from it). ``excerpt`` is the chunk's whole text,
    so a quoted span's offsets are offsets in the chunk version. ``stale`` marks evidence past its
    review date or not CURRENT (``stale_reason`` says which); ``requires_human_gate``: an action
    citing it needs a person's approval whatever the policy says.
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
    locale: str = "en"
    doc_id: str = ""
    stale: bool = False
    stale_reason: str = ""
    requires_human_gate: bool = False
    owner: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


#: Readable and in force: the tenant, the reader's scopes, the current version, approved and
#: published, effective and not expired at ``now`` (apps.evidence.governance).
_IN_FORCE = ("c.is_current AND c.governed AND (c.effective_at IS NULL OR c.effective_at <= %(now)s) "
             "AND (c.expires_at IS NULL OR c.expires_at > %(now)s)")
_PERMITTED = f"c.tenant_id = %(tenant)s AND c.scope = ANY(%(scopes)s) AND {_IN_FORCE}"

#: Vector candidates through the HNSW index, filtered. pgvector 0.6 has no iterative index scan:
#: the scan stops after ``hnsw.ef_search`` neighbours and the filter runs on those, so rare
#: permitted chunks can come back short.
_VEC_HNSW_SQL = f"""
SELECT c.id FROM evidence_chunk c WHERE {_PERMITTED} AND c.embedding_model = %(emodel)s
ORDER BY c.embedding <=> %(qvec)s::vector LIMIT %(cand)s
"""  # noqa: S608 - constant fragments; every value is a bound parameter

#: Exact vector candidates: the permitted rows first (a materialized CTE the index cannot see), then
#: the distance order over them. Complete by construction; cost grows with the permitted rows.
_VEC_EXACT_SQL = f"""
WITH permitted AS MATERIALIZED (SELECT c.id, c.embedding FROM evidence_chunk c
                                WHERE {_PERMITTED} AND c.embedding_model = %(emodel)s)
SELECT id FROM permitted ORDER BY embedding <=> %(qvec)s::vector, id LIMIT %(cand)s
"""  # noqa: S608 - constant fragments; every value is a bound parameter

#: Full-text candidates ranked by cover density (``ts_rank_cd``) among at most this many matches,
#: the best by ``ts_rank``: cover density costs about 8x ``ts_rank`` per row, and an OR of a
#: report's words can match 40% of a large corpus. With no more matches than this (every
#: knowledge base of the repo eval), the order is exactly cover density over all of them.
TEXT_PRESELECT = 500
#: The pre-selection when the match is on a large corpus's rarer words (:mod:`apps.evidence.termstats`):
#: at most ``MATCH_BUDGET`` rows match, and cover density over 500 of them cost about 10 ms.
TEXT_PRESELECT_RARE_WORDS = 100

#: The full-text ranking over ``{rows}``, the rows to rank: every permitted chunk that matches.
#: ``%(match)s`` is the tsquery the rows must match (:func:`apps.evidence.termstats.match_query`:
#: a large corpus is matched on the report's rarer words) or NULL for the whole query; both
#: rankings score every word of the report.
_TEXT_RANKING = """
pre AS MATERIALIZED (
    SELECT c.id, c.search_vector FROM {rows} c, q, m
    WHERE c.search_vector @@ m.tsq
    ORDER BY ts_rank(c.search_vector, q.tsq) DESC, c.id
    LIMIT %(pre)s
)
SELECT pre.id FROM pre, q
ORDER BY ts_rank_cd(pre.search_vector, q.tsq) DESC, pre.id
LIMIT %(cand)s
"""
_TEXT_QUERY = """
WITH q AS (
    SELECT to_tsquery('english', replace(plainto_tsquery('english', %(qtext)s)::text, '&', '|'))
           || to_tsquery('simple', %(qcjk)s) AS tsq
), m AS (
    SELECT coalesce(%(match)s::tsquery, q.tsq) AS tsq FROM q
),"""
#: Through the full-text index: the matching rows of the tenant, then the permitted ones among them.
_TEXT_SQL = _TEXT_QUERY + _TEXT_RANKING.format(
    rows=f"(SELECT * FROM evidence_chunk c WHERE {_PERMITTED})")  # noqa: S608 - constant fragments
#: Over the permitted rows first, when there are few of them (at most ``termstats.MATCH_BUDGET`` at
#: the last count): the index would read every matching row of the tenant to keep a few. Same
#: rows, same order.
_TEXT_FEW_SQL = _TEXT_QUERY + f"""
permitted AS MATERIALIZED (SELECT c.id, c.search_vector FROM evidence_chunk c WHERE {_PERMITTED}),
""" + _TEXT_RANKING.format(rows="permitted")  # noqa: S608 - constant fragments; values are bound parameters

#: The permitted rows, counted up to ``%(cap)s``: enough to choose the strategy without reading every
#: row of a large tenant (counting 100k rows cost about 30 ms a query).
_COUNT_SQL = f"""
SELECT count(*) FROM (SELECT 1 FROM evidence_chunk c WHERE {_PERMITTED} AND c.embedding_model = %(emodel)s
                      LIMIT %(cap)s) permitted
"""  # noqa: S608 - constant fragments; every value is a bound parameter

#: At most this many permitted rows are ranked exactly from the start (cheaper than an HNSW scan that
#: would come back short); above it the index answers first.
EXACT_MAX_ROWS = 5000

#: ``hnsw.ef_search`` for the index scan: the candidate list the graph walk keeps. With the index built
#: at m=16, ef_construction=128 this gives recall@10 0.984 on the bench's 100k chunks in 9 ms (p50);
#: the index at ef_construction=64 and ef_search 200 gave 0.902.
HNSW_EF_SEARCH = 300


def vector_candidates(cur, *, tenant_id: int, scopes, qvec: str, limit: int,
                      now: datetime | None = None, model: str | None = None) -> tuple[list[int], str]:
    """The ``limit`` permitted chunks nearest to ``qvec`` (a pgvector literal), nearest first, and
    the strategy used: ``"exact"`` or ``"hnsw"``.

    Complete: it returns ``min(limit, permitted rows)`` ids, whatever share of the tenant's chunks
    the scopes permit. At most :data:`EXACT_MAX_ROWS` permitted rows are ranked exactly;
    otherwise the HNSW index answers (whether there are more is read from the last count of the
    tenant's chunks, :func:`apps.evidence.termstats.counted_chunks`, when it says so, else
    counted up to the cap), and a short answer (the filter removed too many of its
    neighbours, as it does when the scopes permit a small share of a large tenant) is redone
    exactly. Only chunks in force at ``now`` (default: the current time) and embedded by ``model``
    (default: the configured one; ``qvec`` must be its embedding) are candidates. ``cur`` is a
    cursor inside a transaction."""
    params = {"tenant": tenant_id, "scopes": list(scopes), "qvec": qvec, "cand": limit, "now": now or timezone.now(),
              "emodel": model or model_configured(), "cap": EXACT_MAX_ROWS + 1}
    counted = counted_chunks(cur, tenant_id=tenant_id, scopes=scopes)
    if counted is not None and counted > EXACT_MAX_ROWS:
        permitted = EXACT_MAX_ROWS + 1  # many at the last count: the index answers first
    else:
        sql.execute_unprepared(cur, _COUNT_SQL, params)
        permitted = cur.fetchone()[0]  # exact up to EXACT_MAX_ROWS; above it, "more"
    if permitted == 0:
        return [], "exact"
    if permitted <= EXACT_MAX_ROWS:
        sql.execute_unprepared(cur, _VEC_EXACT_SQL, params)
        return [r[0] for r in cur.fetchall()], "exact"
    cur.execute("SELECT set_config('hnsw.ef_search', %s, true)", [str(max(HNSW_EF_SEARCH, 2 * limit))])
    sql.execute_unprepared(cur, _VEC_HNSW_SQL, params)
    ids = [r[0] for r in cur.fetchall()]
    if len(ids) < limit:  # more than the cap are permitted: a short answer is redone exactly
        sql.execute_unprepared(cur, _VEC_EXACT_SQL, params)
        return [r[0] for r in cur.fetchall()], "exact"
    return ids, "hnsw"


def text_candidates(cur, *, tenant_id: int, scopes, query: str, limit: int, now: datetime | None = None) -> list[int]:
    """The ``limit`` permitted chunks in force at ``now`` best matching ``query`` in full text,
    best first: its English words (any of them) and its Chinese words (segmented,
    :mod:`apps.evidence.textsearch`). Over a reader's many permitted chunks, only the chunks
    containing one of the report's rarer words are ranked (:mod:`apps.evidence.termstats`); a
    reader's few permitted chunks are read first and matched among themselves."""
    match, counted = match_query(cur, tenant_id=tenant_id, scopes=scopes, query=query, words=segmented(query))
    few = counted is not None and counted <= termstats.MATCH_BUDGET
    params = {"tenant": tenant_id, "scopes": list(scopes), "qtext": query, "cand": limit, "match": match,
              "pre": max(limit, TEXT_PRESELECT if match is None else TEXT_PRESELECT_RARE_WORDS),
              "qcjk": cjk_tsquery(query), "now": now or timezone.now()}
    # Planned for this reader each time: its best plan depends on how much the reader may see.
    sql.execute_unprepared(cur, _TEXT_FEW_SQL if few else _TEXT_SQL, params)
    return [r[0] for r in cur.fetchall()]


def rrf_fuse(*rankings: list[int], k: int, rrf_k: int = RRF_K) -> list[tuple[int, float, list[int | None]]]:
    """Reciprocal rank fusion: ``[(id, score, [rank in each ranking or None])]``, best first (ties
    by id), at most ``k``. ``score = Σ 1 / (rrf_k + rank)`` over the rankings an id appears in."""
    scores: dict[int, float] = {}
    ranks: dict[int, list[int | None]] = {}
    for i, ranking in enumerate(rankings):
        for rank, cid in enumerate(ranking, start=1):
            scores[cid] = scores.get(cid, 0.0) + 1.0 / (rrf_k + rank)
            ranks.setdefault(cid, [None] * len(rankings))[i] = rank
    best = sorted(scores, key=lambda c: (-scores[c], c))[:k]
    return [(c, scores[c], ranks[c]) for c in best]


def vector_literal(values) -> str:
    """``values`` (a sequence of floats, e.g. an embedding) as a pgvector literal ``"[x,y,...]"``
    with 7 decimals, for a ``%s::vector`` parameter."""
    values = tuple(values)
    return "[" + (_VECTOR_FORMATS.get(len(values)) or _vector_format(len(values))) % values + "]"


_VECTOR_FORMATS: dict[int, str] = {}


def _vector_format(n: int) -> str:
    """The ``%``-format of an ``n``-dimensional vector literal's inside (one format string per
    dimension count, made once: formatting 512 floats in one operation costs a third less than
    joining 512 formatted ones)."""
    _VECTOR_FORMATS[n] = ",".join(["%.7f"] * n)
    return _VECTOR_FORMATS[n]


def evidence_retrieve(
    *, tenant_id: int, scopes: list[str] | tuple[str, ...], query: str, k: int = 5
) -> list[EvidenceRef]:
    """Top-``k`` current chunks of ``tenant_id`` readable with ``scopes`` for ``query``: the
    vector and full-text rankings, each over the permitted chunks only, fused by RRF.

    Returns at most ``k`` :class:`EvidenceRef`, best first. An empty ``scopes`` returns nothing.
    """
    if not scopes or not query.strip():
        return []
    return evidence_rank(tenant_id=tenant_id, scopes=scopes, query=query,
                         qvec=vector_literal(embed_query(query)), k=k)


def evidence_rank(
    *, tenant_id: int, scopes: list[str] | tuple[str, ...], query: str, qvec: str, k: int = 5
) -> list[EvidenceRef]:
    """:func:`evidence_retrieve` after the embedding: ``qvec`` is ``query``'s embedding as a
    pgvector literal (:func:`vector_literal`). Runs the vector and full-text rankings over the
    permitted chunks — at the same time, the text leg on a connection of its own, when the caller
    is in no transaction (:mod:`apps.evidence.parallel`); else one after the other in one
    transaction — fuses them and fetches the chunks.

    Returns at most ``k`` :class:`EvidenceRef`, best first; nothing for an empty ``scopes`` or
    ``query``. (Split out so that ``make bench`` can time the ranking without the model.)
    """
    if not scopes or not query.strip():
        return []
    depth = max(CANDIDATES, k)
    now = timezone.now()
    text_leg = parallel.run_apart(text_candidates, tenant_id=tenant_id, scopes=scopes, query=query, limit=depth,
                                  now=now) if parallel.apart_possible() else None
    with transaction.atomic(), connection.cursor() as cur:
        vec, _ = vector_candidates(cur, tenant_id=tenant_id, scopes=scopes, qvec=qvec, limit=depth, now=now)
        txt = text_leg.result() if text_leg is not None else \
            text_candidates(cur, tenant_id=tenant_id, scopes=scopes, query=query, limit=depth, now=now)
    rows = [(cid, score, r[0], r[1]) for cid, score, r in rrf_fuse(vec, txt, k=k)]
    chunks = {
        c.pk: c
        for c in Chunk.objects.for_tenant(tenant_id).select_related("document_version__document")
        .defer("embedding", "search_vector", "document_version__content")  # not needed; the largest columns
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
    """The chunk if the viewer (tenant + scopes) may read it *now*, else None (re-check on read):
    the scope it was written under and its document's current scope must both be permitted, so
    narrowing a document's scope also hides its older versions."""
    return (
        Chunk.objects.for_tenant(tenant_id).select_related("document_version__document")
        .filter(pk=chunk_id, scope__in=list(scopes), document_version__document__scope__in=list(scopes))
        .first()
    )


@dataclass(frozen=True)
class ChunkNow:
    """What a cited chunk is now, for any reader: ``status`` is ``current``, ``superseded`` (its
    document has a newer version), ``retired`` (its document was withdrawn) or ``gone`` (deleted,
    or another tenant's); ``scopes`` are the scope it was written under and its document's
    current scope, both of which a reader must hold (as :func:`chunk_readable` decides)."""

    status: str
    scopes: tuple[str, ...] = ()

    def readable_by(self, scopes) -> bool:
        return self.status != "gone" and all(s in scopes for s in self.scopes)

    def status_for(self, scopes) -> str:
        """The status a reader holding ``scopes`` sees: ``unreadable`` when they may not read it."""
        return self.status if self.readable_by(scopes) else "unreadable"


def chunks_now(*, tenant_id: int, chunk_ids) -> dict[str, ChunkNow]:
    """``{str(chunk_id): ChunkNow}`` for ``chunk_ids`` (ints or their decimal strings) in the
    tenant, whatever the reader: one query. Readers' views come from :meth:`ChunkNow.status_for`."""
    ids = [int(c) for c in chunk_ids]
    rows = {pk: (current, retired, scope, doc_scope) for pk, current, retired, scope, doc_scope in
            Chunk.objects.for_tenant(tenant_id).filter(pk__in=ids).values_list(
                "pk", "is_current", "document_version__document__retired", "scope",
                "document_version__document__scope")}
    out = {}
    for cid in ids:
        if cid not in rows:
            out[str(cid)] = ChunkNow("gone")
        else:
            current, retired, scope, doc_scope = rows[cid]
            out[str(cid)] = ChunkNow("retired" if retired else ("current" if current else "superseded"),
                                     (scope, doc_scope))
    return out


def chunks_status(*, tenant_id: int, scopes, chunk_ids) -> dict[str, str]:
    """``{str(chunk_id): status}`` for the viewer (tenant + scopes) now: ``current``; ``superseded``
    (its document has a newer version); ``retired`` (its document was withdrawn); ``unreadable``
    (gone, another tenant's, or outside the scopes — as :func:`chunk_readable` decides). One query.
    What a plan's evidence premise records (``reducer/6``)."""
    return {cid: now.status_for(scopes) for cid, now in chunks_now(tenant_id=tenant_id, chunk_ids=chunk_ids).items()}


def readable_chunk_ids(*, tenant_id: int, scopes, chunk_ids) -> set[int]:
    """The subset of ``chunk_ids`` the viewer may read now (one query; see :func:`chunk_readable`)."""
    return set(Chunk.objects.for_tenant(tenant_id).filter(
        pk__in=list(chunk_ids), scope__in=list(scopes), document_version__document__scope__in=list(scopes))
        .values_list("pk", flat=True))


def payload_for_viewer(event_type: str, payload: dict, readable: set[int]) -> dict:
    """An event payload as a viewer sees it: the excerpts of evidence the viewer may not read now
    are replaced by a notice (the references — document, version, section — stay)."""
    if event_type != "evidence.retrieved" or not payload.get("refs"):
        return payload
    refs = [r if r.get("chunk_id") in readable else {**r, "excerpt": f"[not shown: scope {r.get('scope')}]"}
            for r in payload["refs"]]
    return {**payload, "refs": refs}
