"""The full-text leg over many permitted chunks matches on a report's rarer words
(apps.evidence.termstats): frequencies counted per tenant and scope, the rarest words picked
within a budget, the ranking still over every word, and nothing the reader may not read (another
scope, another tenant) changing which words are picked."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.accounts.models import Tenant
from apps.evidence import termstats
from apps.evidence.models import Chunk, Document, DocumentVersion, TermFrequency, TermStatistics
from apps.evidence.selectors import text_candidates


def _chunks(tenant, scope: str, texts: list[str], *, source: str | None = None) -> list[int]:
    """``texts`` as current chunks of one new document of ``tenant`` in ``scope``, their
    ``search_vector`` filled as ingest fills it; their ids in order."""
    doc = Document.objects.create(tenant=tenant, source=source or f"{scope}/t{Document.objects.count()}.md",
                                  title="t", scope=scope, current_version=1)
    version = DocumentVersion.objects.create(document=doc, version=1, content_digest="x", content="x")
    rows = Chunk.objects.bulk_create([
        Chunk(document_version=version, tenant=tenant, scope=scope, ordinal=i, section="", start_offset=0,
              end_offset=len(t), text=t, content_digest=str(i)) for i, t in enumerate(texts)])
    with connection.cursor() as cur:
        cur.execute("UPDATE evidence_chunk SET search_vector = to_tsvector('english', text) "
                    "WHERE document_version_id = %s", [version.pk])
    return [r.pk for r in rows]


def _match(tenant, scopes, query):
    with connection.cursor() as cur:
        return termstats.match_query(cur, tenant_id=tenant.pk, scopes=scopes, query=query, words="")[0]


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setattr(termstats, "MATCH_BUDGET", 10)
    monkeypatch.setattr(termstats, "MIN_STORED", 1)


def test_counts_are_per_scope_and_only_of_current_chunks(tenant, small_budget):
    _chunks(tenant, "public", ["paper jam in tray two", "paper is low", "toner is low"])
    old = _chunks(tenant, "tier2", ["paper paper", "fuser error"])
    Chunk.objects.filter(pk=old[0]).update(is_current=False)
    stored = termstats.term_statistics_refresh(tenant.pk)
    counts = {(f.scope, f.lexeme): f.chunks for f in TermFrequency.objects.for_tenant(tenant.pk)}
    assert stored == len(counts)
    assert counts[("public", "paper")] == 2 and counts[("public", "low")] == 2 and counts[("public", "")] == 3
    assert counts[("tier2", "")] == 1 and ("tier2", "paper") not in counts and counts[("tier2", "fuser")] == 1
    stats = TermStatistics.objects.get(tenant=tenant)
    assert stats.current_chunks == 4


def test_few_permitted_chunks_match_every_word(tenant):
    _chunks(tenant, "public", ["paper jam in tray two"] * 5)
    termstats.term_statistics_refresh(tenant.pk)
    assert _match(tenant, ["public"], "paper jam tray") is None


def test_many_permitted_chunks_match_the_rarest_words_within_the_budget(tenant, small_budget, monkeypatch):
    # "paper" in 12 chunks, "jam" in 6, "tray" in 3, "fuser" in none
    ids = _chunks(tenant, "public", ["paper"] * 6 + ["paper jam"] * 3 + ["paper jam tray"] * 3)
    termstats.term_statistics_refresh(tenant.pk)
    # rarest first: tray (3), jam (6), paper (12); after jam the sum is 9, under the budget of 10, so
    # paper is picked too: every word fits, and the match is the whole query
    assert _match(tenant, ["public"], "paper jam tray") is None
    monkeypatch.setattr(termstats, "MATCH_BUDGET", 5)
    assert _match(tenant, ["public"], "paper jam tray fuser") == "'fuser' | 'tray' | 'jam'"
    monkeypatch.setattr(termstats, "MATCH_BUDGET", 3)
    assert _match(tenant, ["public"], "paper jam tray") == "'tray'"
    with connection.cursor() as cur:
        got = text_candidates(cur, tenant_id=tenant.pk, scopes=["public"], query="paper jam tray", limit=50)
    # only the chunks with the rare word are matched, ranked over every word
    assert sorted(got) == sorted(ids[9:])


def test_what_a_reader_may_not_read_does_not_change_the_words_picked(tenant, small_budget, monkeypatch):
    _chunks(tenant, "public", ["paper jam"] * 4 + ["paper tray"] * 8)
    termstats.term_statistics_refresh(tenant.pk)
    monkeypatch.setattr(termstats, "MATCH_BUDGET", 5)
    before = _match(tenant, ["public"], "paper jam tray")
    assert before == "'jam' | 'tray'"  # jam (4) is under 5, so tray (8) comes in; paper (12) does not
    # "jam" becomes common in a scope the reader lacks, and in another tenant
    _chunks(tenant, "security", ["jam jam"] * 50)
    other = Tenant.objects.create(slug="globex", name="Globex")
    _chunks(other, "public", ["jam"] * 50 + ["tray"] * 50)
    assert termstats.term_statistics_refresh_changed() == 2
    assert _match(tenant, ["public"], "paper jam tray") == before
    assert _match(tenant, ["public", "security"], "paper jam tray") == "'tray'"


def test_the_beat_job_recounts_only_tenants_whose_chunks_changed(tenant, small_budget):
    ids = _chunks(tenant, "public", ["paper jam"] * 3)
    assert termstats.term_statistics_refresh_changed() == 1
    assert termstats.term_statistics_refresh_changed() == 0
    Chunk.objects.filter(pk=ids[0]).update(is_current=False)  # a retired chunk: the count changed
    assert termstats.term_statistics_refresh_changed() == 1
    assert TermFrequency.objects.get(tenant=tenant, scope="public", lexeme="paper").chunks == 2
    Chunk.objects.filter(tenant=tenant).update(is_current=False)  # nothing current any more
    assert termstats.term_statistics_refresh_changed() == 1
    assert not TermFrequency.objects.for_tenant(tenant.pk).exists()
    assert termstats.term_statistics_refresh_changed() == 0


def test_a_lexeme_with_quotes_and_backslashes_is_a_valid_operand(tenant):
    with connection.cursor() as cur:
        for lexeme in ["o'brien", "back\\slash", "'", "plain"]:
            cur.execute("SELECT %s::tsquery", [termstats._quoted(lexeme)])
            cur.execute("SELECT to_tsvector('simple', 'x') || array_to_tsvector(ARRAY[%s]) @@ %s::tsquery",
                        [lexeme, termstats._quoted(lexeme)])
            assert cur.fetchone()[0] is True, lexeme


@pytest.mark.django_db(transaction=True)
def test_the_legs_run_apart_outside_a_transaction_and_give_what_they_give_together(settings):
    """Outside a transaction the text leg runs on the helper connection at the same time as the
    vector leg; the fused answer is the one both legs give on one connection."""
    import numpy as np

    from apps.evidence import parallel
    from apps.evidence.models import EMBEDDING_DIMENSIONS
    from apps.evidence.selectors import evidence_rank, vector_literal

    tenant = Tenant.objects.create(slug="legs", name="Legs")
    texts = ["paper jam in tray two", "toner low warning", "fuser error after warm-up", "paper jam again"] * 5
    ids = _chunks(tenant, "public", texts)
    rng = np.random.default_rng(3)
    for cid in ids:
        v = rng.normal(size=EMBEDDING_DIMENSIONS)
        Chunk.objects.filter(pk=cid).update(embedding=(v / np.linalg.norm(v)).tolist())
    q = rng.normal(size=EMBEDDING_DIMENSIONS)
    qvec = vector_literal(q / np.linalg.norm(q))
    calls = []
    real = parallel.run_apart
    try:
        parallel.run_apart = lambda fn, **kw: calls.append(fn.__name__) or real(fn, **kw)
        apart = evidence_rank(tenant_id=tenant.pk, scopes=["public"], query="paper jam tray", qvec=qvec, k=5)
        assert calls == ["text_candidates"]
        settings.FAULTDESK = {**settings.FAULTDESK, "RETRIEVAL_PARALLEL_LEGS": False}
        together = evidence_rank(tenant_id=tenant.pk, scopes=["public"], query="paper jam tray", qvec=qvec, k=5)
        assert calls == ["text_candidates"]
    finally:
        parallel.run_apart = real
        parallel.close()
    assert [r.chunk_id for r in apart] == [r.chunk_id for r in together] and len(apart) == 5
    assert any(r.text_rank is not None for r in apart), "the text leg's ranks reached the fusion"


def test_inside_a_transaction_both_legs_run_on_the_callers_connection(tenant, monkeypatch):
    """The test's transaction holds uncommitted chunks the helper connection could not see: both
    legs run here, and the text leg finds them."""
    from apps.evidence import parallel
    from apps.evidence.models import EMBEDDING_DIMENSIONS
    from apps.evidence.selectors import evidence_rank

    monkeypatch.setattr(parallel, "run_apart", lambda *a, **k: pytest.fail("a leg left the transaction"))
    ids = _chunks(tenant, "public", ["paper jam in tray two", "toner low"])
    Chunk.objects.filter(pk__in=ids).update(embedding=[1.0] + [0.0] * (EMBEDDING_DIMENSIONS - 1))
    assert parallel.apart_possible() is False
    refs = evidence_rank(tenant_id=tenant.pk, scopes=["public"], query="paper jam",
                         qvec="[" + ",".join(["1"] + ["0"] * (EMBEDDING_DIMENSIONS - 1)) + "]", k=5)
    assert refs[0].chunk_id == ids[0] and refs[0].text_rank == 1


def test_few_permitted_rows_read_first_give_the_same_rows_in_the_same_order(tenant):
    """A reader whose scopes hold few chunks (by the last count) is matched over those rows
    first; the answer is the index path's, row for row."""
    from apps.evidence import selectors

    _chunks(tenant, "public", ["paper jam in tray two", "paper paper jam", "tray", "jam tray paper", "toner"] * 3)
    _chunks(tenant, "security", ["paper jam"] * 20)
    query = "paper jam tray"
    with connection.cursor() as cur:
        before = text_candidates(cur, tenant_id=tenant.pk, scopes=["public"], query=query, limit=50)
        termstats.term_statistics_refresh(tenant.pk)
        assert termstats.match_query(cur, tenant_id=tenant.pk, scopes=["public"], query=query, words="") == (None, 15)
        with CaptureQueriesContext(connection) as captured:
            after = text_candidates(cur, tenant_id=tenant.pk, scopes=["public"], query=query, limit=50)
    assert selectors._TEXT_FEW_SQL in [q["sql"] for q in captured.captured_queries]
    assert after == before and len(after) == 12
