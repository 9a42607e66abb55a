"""Document frequencies for the full-text leg (DESIGN.md §9): which words of a report are rare
enough to look up.

The full-text leg ORs a report's words. At 100k chunks an OR of "printer", "code" and "page"
matches 40% of the corpus, and reading those rows alone costs more than the whole retrieval
budget. A word in a large share of the chunks says little about which chunk answers the report
(BM25 gives it almost no weight), so when a reader's permitted chunks are many, the match uses
the report's rarest words, adding them rarest first while the chunks they can match (the sum of
their frequencies) stay under :data:`MATCH_BUDGET`; the ranking still scores every word. A reader
who may see at most :data:`MATCH_BUDGET` chunks (every knowledge base of the repo eval) gets
the plain OR of all words, exactly as before.

Frequencies are counted per tenant and scope with PostgreSQL's ``ts_stat`` over the current
chunks (:func:`term_statistics_refresh`; about 0.4 s for 100k chunks), by a beat job for each
tenant whose chunks changed. A reader's frequency of a word is the sum over the scopes they may
read, so which words are used never depends on chunks the reader may not read, or on another
tenant's. A tenant never counted, or a word never counted, is treated as rare: the match only
widens.
"""

from __future__ import annotations

import logging

from django.db import connection, transaction
from django.utils import timezone

from apps.evidence.models import TermFrequency, TermStatistics

log = logging.getLogger(__name__)

#: The most chunks the lexemes picked for a match may contain between them (their summed
#: frequencies): the rarest lexeme is always picked, the next ones while the sum so far is under it.
MATCH_BUDGET = 1000
#: Lexemes in fewer current chunks (of one scope) than this are not stored: a missing lexeme is rare.
MIN_STORED = 50

_STATS_SQL = """
INSERT INTO evidence_termfrequency (tenant_id, scope, lexeme, chunks)
SELECT %(tenant)s, %(scope)s, word, ndoc FROM ts_stat(format(
    'SELECT search_vector FROM evidence_chunk WHERE tenant_id = %%s AND scope = %%L AND is_current',
    %(tenant)s::bigint, %(scope)s::text))
WHERE ndoc >= %(min)s AND length(word) <= 255
"""

#: The chunks the reader's scopes held at the last count: one row, or none when never counted.
_COUNTED_SQL = """(SELECT coalesce(sum(chunks), 0) FROM evidence_termfrequency
        WHERE tenant_id = %(tenant)s AND scope = ANY(%(scopes)s) AND lexeme = '')
FROM evidence_termstatistics WHERE tenant_id = %(tenant)s
"""

_LEXEMES_SQL = """
WITH words AS (
    SELECT DISTINCT unnest(tsvector_to_array(to_tsvector('english', %(qtext)s)
                                             || to_tsvector('simple', %(qwords)s))) AS lexeme
)
SELECT w.lexeme, coalesce(sum(f.chunks), 0) FROM words w
LEFT JOIN evidence_termfrequency f
       ON f.tenant_id = %(tenant)s AND f.scope = ANY(%(scopes)s) AND f.lexeme = w.lexeme
GROUP BY w.lexeme
UNION ALL
SELECT '', """ + _COUNTED_SQL  # noqa: S608 - constant fragments; every value is a bound parameter



def term_statistics_refresh(tenant_id: int) -> int:
    """Recount the document frequencies of ``tenant_id``'s current chunks, per scope, in one
    transaction (readers see the old counts or the new, never a mix). Returns the number of rows
    stored (lexemes per scope, plus one chunk count per scope)."""
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT scope, count(*), max(id) FROM evidence_chunk WHERE tenant_id = %s AND is_current "
                    "GROUP BY scope", [tenant_id])
        rows = cur.fetchall()
        scopes = [(scope, chunks) for scope, chunks, _ in rows]
        current = sum(chunks for _, chunks in scopes)
        last_id = max((last for *_, last in rows), default=0)
        TermFrequency.objects.for_tenant(tenant_id).delete()
        for scope, _ in scopes:
            cur.execute(_STATS_SQL, {"tenant": tenant_id, "scope": scope, "min": MIN_STORED})
        TermFrequency.objects.bulk_create(
            [TermFrequency(tenant_id=tenant_id, scope=scope, lexeme="", chunks=chunks) for scope, chunks in scopes])
        TermStatistics.objects.update_or_create(
            tenant_id=tenant_id,
            defaults={"refreshed_at": timezone.now(), "current_chunks": current, "last_chunk_id": last_id})
        return TermFrequency.objects.for_tenant(tenant_id).count()


def term_statistics_refresh_changed() -> int:
    """Recount every tenant whose current chunks changed (their number or the highest id) since
    its last count, or that was never counted and has chunks (the beat job). Returns how many
    tenants were recounted; one that fails is logged and left for the next run."""
    with connection.cursor() as cur:
        cur.execute("""
            SELECT c.tenant_id FROM (SELECT tenant_id, count(*) AS n, max(id) AS last FROM evidence_chunk
                                     WHERE is_current GROUP BY tenant_id) c
            LEFT JOIN evidence_termstatistics s ON s.tenant_id = c.tenant_id
            WHERE s.tenant_id IS NULL OR s.current_chunks <> c.n OR s.last_chunk_id <> c.last
            UNION
            SELECT s.tenant_id FROM evidence_termstatistics s
            WHERE NOT EXISTS (SELECT 1 FROM evidence_chunk c WHERE c.tenant_id = s.tenant_id AND c.is_current)
              AND s.current_chunks > 0""")
        changed = [r[0] for r in cur.fetchall()]
    done = 0
    for tenant_id in changed:
        try:
            term_statistics_refresh(tenant_id)
            done += 1
        except Exception:  # noqa: BLE001 - one tenant must not stop the others; the next run retries
            log.exception("counting the term frequencies of tenant %s failed", tenant_id)
    return done


def counted_chunks(cur, *, tenant_id: int, scopes) -> int | None:
    """How many current chunks of ``tenant_id`` the scopes held at the last count (an upper bound
    of what a reader with ``scopes`` may read then), or None when the tenant was never counted.
    One indexed read; it may be a minute old, so callers use it to choose a strategy, never as a
    result."""
    cur.execute("SELECT " + _COUNTED_SQL, {"tenant": tenant_id, "scopes": list(scopes)})
    row = cur.fetchone()
    return None if row is None else int(row[0])


def _quoted(lexeme: str) -> str:
    """``lexeme`` as a quoted tsquery operand (quotes and backslashes doubled)."""
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


def match_query(cur, *, tenant_id: int, scopes, query: str, words: str) -> tuple[str | None, int | None]:
    """``(match, counted)``: the tsquery text (an OR of quoted lexemes) the full-text leg should
    match ``query`` with, or None to match with every word of it; and how many current chunks the
    reader's ``scopes`` held at the last count (None: the tenant was never counted). ``words`` is
    the query's Chinese words, space-separated (:func:`apps.evidence.textsearch.segmented`).

    ``match`` is None when ``counted`` is at most :data:`MATCH_BUDGET` or unknown, or when every
    lexeme fits in the budget. Otherwise the lexemes in ascending frequency (ties by lexeme) while
    the frequencies summed so far are under the budget; the rarest is always among them. ``cur``
    is a cursor."""
    cur.execute(_LEXEMES_SQL, {"tenant": tenant_id, "scopes": list(scopes), "qtext": query, "qwords": words})
    rows = cur.fetchall()
    counted = next((int(n) for lexeme, n in rows if lexeme == ""), None)
    frequencies = sorted((int(n), lexeme) for lexeme, n in rows if lexeme)
    if counted is None or counted <= MATCH_BUDGET or not frequencies:
        return None, counted
    picked, total = [], 0
    for n, lexeme in frequencies:
        if total >= MATCH_BUDGET:
            break
        picked.append(lexeme)
        total += n
    if len(picked) == len(frequencies):
        return None, counted
    return " | ".join(_quoted(lexeme) for lexeme in picked), counted
