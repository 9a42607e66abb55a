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


def _corpus(tenant, sizes: dict[str, int], seed: int = 7) -> dict[int, np.ndarray]:
    """Random unit vectors, ``sizes[scope]`` chunks per scope, written directly (no embedding
    model): ``{chunk id: vector}``."""
    rng = np.random.default_rng(seed)
    vectors = {}
    for scope, n in sizes.items():
        doc = Document.objects.create(tenant=tenant, source=f"{scope}/synthetic.md", title=f"{scope} synthetic",
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
        monkeypatch.setattr(selectors, "EXACT_SELECTIVITY", 0.0)
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
