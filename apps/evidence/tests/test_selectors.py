"""A filtered top-k query returns k permitted results even when permitted chunks are rare: 1,990
chunks in one scope and 10 in another, and 1 in 200. The embedded pgvector 0.6 has no iterative
index scan, so a filtered HNSW scan alone comes back short;
:func:`apps.evidence.selectors.vector_candidates` ranks rare permitted rows exactly and redoes a
short HNSW answer exactly."""

from __future__ import annotations

import numpy as np
import pytest
from django.db import connection, transaction
from django.utils import timezone

from apps.evidence import selectors
from apps.evidence.embedding import model_configured
from apps.evidence.models import EMBEDDING_DIMENSIONS, Chunk, Document, DocumentVersion

DIM = EMBEDDING_DIMENSIONS


def _corpus(tenant, sizes: dict[str, int], seed: int = 7, name: str = "synthetic") -> dict[int, np.ndarray]:
    """Random unit vectors, ``sizes[scope]`` chunks per scope, written directly (no embedding
    model): ``{chunk id: vector}``."""
    rng = np.random.default_rng(seed)
    vectors = {}
    for scope, n in sizes.items():
        doc = Document.objects.create(tenant=tenant, source=f"{scope}/{name}.md", title=f"{scope} {name}",
                                      scope=scope, current_version=1)
        version = DocumentVersion.objects.create(document=doc, version=1, content_digest="x", content="x")
        vecs = rng.normal(size=(n, DIM)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        rows = Chunk.objects.bulk_create([
            Chunk(document_version=version, tenant=tenant, scope=scope, ordinal=i, section="s", start_offset=0,
                  end_offset=1, text=f"chunk {i}", content_digest="x", embedding=v.tolist())
            for i, v in enumerate(vecs)], batch_size=500)
        vectors.update({c.pk: v for c, v in zip(rows, vecs, strict=True)})
    return vectors


def _exact(vectors: dict[int, np.ndarray], permitted: set[int], q: np.ndarray, k: int) -> list[int]:
    ids = sorted(permitted)
    dist = [1 - float(vectors[i] @ q) for i in ids]
    return [i for _, i in sorted(zip(dist, ids, strict=True))][:k]


def _search(tenant, scopes, q, k, *, planner_uses_the_index=False):
    qvec = "[" + ",".join(f"{x:.7f}" for x in q) + "]"
    with transaction.atomic(), connection.cursor() as cur:
        if planner_uses_the_index:
            # On a corpus this small the planner would rather sort the filtered rows (exact by
            # luck); make it walk the HNSW index as it does on a large one.
            cur.execute("SET LOCAL enable_sort = off")
            cur.execute("SET LOCAL enable_bitmapscan = off")
        return selectors.vector_candidates(cur, tenant_id=tenant.pk, scopes=scopes, qvec=qvec, limit=k)


@pytest.mark.parametrize("force_index", [False, True], ids=["chosen-strategy", "hnsw-first"])
def test_10_permitted_among_2000_still_gives_5_equal_to_exact_search(tenant, force_index, monkeypatch):
    vectors = _corpus(tenant, {"public": 1990, "security": 10})
    security = set(Chunk.objects.filter(scope="security").values_list("pk", flat=True))
    if force_index:  # the index answers first; its short answer must be redone exactly
        monkeypatch.setattr(selectors, "EXACT_MAX_ROWS", 0)
        with transaction.atomic(), connection.cursor() as cur:  # the index alone does come back short
            cur.execute("SET LOCAL enable_sort = off")
            cur.execute("SET LOCAL enable_bitmapscan = off")
            cur.execute("SET LOCAL hnsw.ef_search = 40")
            cur.execute(selectors._VEC_HNSW_SQL, {"tenant": tenant.pk, "scopes": ["security"], "cand": 5,
                                                  "now": timezone.now(), "emodel": model_configured(),
                                                  "qvec": "[" + ",".join(["0.05"] * DIM) + "]"})
            assert len(cur.fetchall()) < 5
    rng = np.random.default_rng(1)
    for _ in range(5):
        q = rng.normal(size=DIM).astype(np.float32)
        q /= np.linalg.norm(q)
        ids, strategy = _search(tenant, ["security"], q, 5, planner_uses_the_index=force_index)
        assert len(ids) == 5 and set(ids) <= security
        assert ids == _exact(vectors, security, q, 5)
        assert strategy == "exact"


def test_1_permitted_in_200(tenant):
    vectors = _corpus(tenant, {"public": 199, "tier2": 1})
    only = set(Chunk.objects.filter(scope="tier2").values_list("pk", flat=True))
    q = np.ones(DIM, dtype=np.float32) / np.sqrt(DIM)
    ids, _ = _search(tenant, ["tier2"], q, 5)
    assert ids == sorted(only), "the one permitted chunk, and nothing else"
    both, _ = _search(tenant, ["tier2", "public"], q, 5)
    assert both == _exact(vectors, set(vectors), q, 5)


def test_a_wide_scope_uses_the_index(tenant, monkeypatch):
    monkeypatch.setattr(selectors, "EXACT_MAX_ROWS", 100)
    _corpus(tenant, {"public": 600})
    q = np.ones(DIM, dtype=np.float32) / np.sqrt(DIM)
    ids, strategy = _search(tenant, ["public"], q, 5)
    assert strategy == "hnsw" and len(ids) == 5


_FULL_COVER_DENSITY_SQL = """
WITH q AS (SELECT to_tsquery('english', replace(plainto_tsquery('english', %(qtext)s)::text, '&', '|')) AS tsq)
SELECT c.id FROM evidence_chunk c, q WHERE c.tenant_id = %(tenant)s AND c.search_vector @@ q.tsq
ORDER BY ts_rank_cd(c.search_vector, q.tsq) DESC, c.id
"""


def _text_corpus(tenant, texts: list[str]) -> None:
    doc = Document.objects.create(tenant=tenant, source="public/text.md", title="text", scope="public",
                                  current_version=1)
    version = DocumentVersion.objects.create(document=doc, version=1, content_digest="x", content="x")
    Chunk.objects.bulk_create([
        Chunk(document_version=version, tenant=tenant, scope="public", ordinal=i, section="", start_offset=0,
              end_offset=len(t), text=t, content_digest=str(i)) for i, t in enumerate(texts)])
    with connection.cursor() as cur:
        cur.execute("UPDATE evidence_chunk SET search_vector = to_tsvector('english', text) WHERE tenant_id = %s",
                    [tenant.pk])


TEXTS = [
    "paper jam in tray 2; open the tray and remove the paper",  # dense: the words close together
    "paper " + "filler " * 30 + "jam",  # the same words far apart: lower cover density
    "tray 2 holds the paper",
    "jam jam jam",
    "the toner is low",  # no match
    "paper paper tray tray jam jam",
    "replace the paper",
]


def test_full_text_order_is_cover_density_over_every_match_when_there_are_few(tenant):
    _text_corpus(tenant, TEXTS)
    query = "paper jam tray 2"
    with connection.cursor() as cur:
        cur.execute(_FULL_COVER_DENSITY_SQL, {"qtext": query, "tenant": tenant.pk})
        full = [r[0] for r in cur.fetchall()]
        got = selectors.text_candidates(cur, tenant_id=tenant.pk, scopes=["public"], query=query, limit=50)
    assert len(full) == 6 and got == full


#: five matches whose cover-density order (0, 4, 1, 3, 2) differs from their ts_rank order (4, 1, 3, 0, 2)
SPREAD = ["jam jam tray tray jam tray more other tray other tray other filler jam",
          "tray more more more more jam more paper filler paper paper",
          "more jam",
          "jam other other jam tray paper",
          "paper paper paper tray jam more tray jam jam"]


def test_many_matches_are_preselected_by_rank_then_ordered_by_cover_density(tenant, monkeypatch):
    _text_corpus(tenant, SPREAD)
    ids = list(Chunk.objects.filter(tenant=tenant).order_by("ordinal").values_list("pk", flat=True))
    monkeypatch.setattr(selectors, "TEXT_PRESELECT", 2)
    query = "paper jam tray"
    with connection.cursor() as cur:
        cur.execute(_FULL_COVER_DENSITY_SQL, {"qtext": query, "tenant": tenant.pk})
        assert [r[0] for r in cur.fetchall()] == [ids[0], ids[4], ids[1], ids[3], ids[2]]
        got = selectors.text_candidates(cur, tenant_id=tenant.pk, scopes=["public"], query=query, limit=2)
        more = selectors.text_candidates(cur, tenant_id=tenant.pk, scopes=["public"], query=query, limit=5)
    # the two best by ts_rank (4 and 1), in cover-density order: 0 ranks first by cover density but is
    # not among them
    assert got == [ids[4], ids[1]]
    # a limit above the pre-selection widens it: every match, in cover-density order
    assert more == [ids[0], ids[4], ids[1], ids[3], ids[2]]


def test_the_last_term_count_chooses_the_index_and_a_stale_one_never_loses_rows(tenant, monkeypatch):
    """Above the cap by the last count, the permitted rows are not counted again and the index
    answers; a count that went stale either way still gives the complete answer."""
    from apps.evidence.termstats import term_statistics_refresh

    monkeypatch.setattr(selectors, "EXACT_MAX_ROWS", 100)
    vectors = _corpus(tenant, {"public": 600})
    term_statistics_refresh(tenant.pk)
    q = np.ones(DIM, dtype=np.float32) / np.sqrt(DIM)
    ids, strategy = _search(tenant, ["public"], q, 5)
    assert strategy == "hnsw" and len(ids) == 5
    keep = sorted(vectors)[:3]  # all but three retired since the count: the count says 600
    Chunk.objects.filter(tenant=tenant).exclude(pk__in=keep).update(is_current=False)
    ids, strategy = _search(tenant, ["public"], q, 5)
    assert strategy == "exact" and ids == _exact(vectors, set(keep), q, 5)
    term_statistics_refresh(tenant.pk)  # the count says 3; then 600 more arrive
    more = _corpus(tenant, {"public": 600}, seed=8, name="more")
    ids, strategy = _search(tenant, ["public"], q, 5)
    assert strategy == "hnsw" and len(ids) == 5 and set(ids) <= set(more) | set(keep)
