"""Retrieval evaluation (issue 6 item 6): a labelled question set over the project's knowledge base,
scored for the vector ranking alone, the full-text ranking alone and their RRF fusion.

Each question names the documents that answer it and the scopes of a reader who may see them
(``apps/evidence/eval/questions.json``). Rankings are per chunk; a document ranks where its first
chunk does. Metrics, averaged over the questions, with binary relevance:

* recall@5: the share of the relevant documents in the top 5;
* MRR: 1 / the rank of the first relevant document (0 when none is in the top 10);
* nDCG@10: DCG of the top 10 over the ideal DCG.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from django.db import connection, transaction

from apps.evidence.embedding import embed_texts
from apps.evidence.models import Chunk
from apps.evidence.selectors import rrf_fuse, text_candidates, vector_candidates

QUESTIONS = Path(__file__).resolve().parent / "eval" / "questions.json"
DEPTH = 10
METHODS = ("vector", "text", "hybrid")


@dataclass(frozen=True)
class Scores:
    """Mean metrics of one method over ``n`` questions."""

    method: str
    n: int
    recall_at_5: float
    mrr: float
    ndcg_at_10: float


def questions_load(path: Path = QUESTIONS) -> list[dict]:
    """The labelled set: ``[{"q", "relevant": [source], "scopes": [scope]}]``. Raises ``ValueError``
    for a malformed entry."""
    items = json.loads(path.read_text())
    for i, item in enumerate(items):
        if not (isinstance(item.get("q"), str) and item.get("relevant") and item.get("scopes")):
            raise ValueError(f"question {i}: needs q, relevant and scopes")
    return items


def _doc_ranking(chunk_ids: list[int], source_of: dict[int, str]) -> list[str]:
    seen: list[str] = []
    for cid in chunk_ids:
        src = source_of[cid]
        if src not in seen:
            seen.append(src)
    return seen


def _matches(source: str, relevant: str) -> bool:
    # Labels are "kb/<scope>/<file>"; stored sources are relative to the ingested folder's parent.
    return source == relevant or relevant.endswith("/" + source) or source.endswith(relevant.split("/", 1)[-1])


def _metrics(ranking: list[str], relevant: list[str]) -> tuple[float, float, float]:
    hits = [any(_matches(src, r) for r in relevant) for src in ranking[:DEPTH]]
    found = {r for r in relevant if any(_matches(src, r) for src in ranking[:5])}
    recall = len(found) / len(relevant)
    mrr = next((1.0 / (i + 1) for i, h in enumerate(hits) if h), 0.0)
    dcg = sum(1.0 / math.log2(i + 2) for i, h in enumerate(hits) if h)
    ideal = sum(1.0 / math.log2(i + 2) for i in range(min(len(relevant), DEPTH)))
    return recall, mrr, dcg / ideal


def evaluate(*, tenant_id: int, questions: list[dict]) -> list[Scores]:
    """Score each method over ``questions`` against the tenant's current chunks."""
    vectors = embed_texts([item["q"] for item in questions])
    source_of = dict(Chunk.objects.for_tenant(tenant_id).filter(is_current=True)
                     .values_list("pk", "document_version__document__source"))
    sums = {m: [0.0, 0.0, 0.0] for m in METHODS}
    with transaction.atomic(), connection.cursor() as cur:
        for item, vec in zip(questions, vectors, strict=True):
            qvec = "[" + ",".join(f"{x:.7f}" for x in vec) + "]"
            v, _ = vector_candidates(cur, tenant_id=tenant_id, scopes=item["scopes"], qvec=qvec, limit=50)
            t = text_candidates(cur, tenant_id=tenant_id, scopes=item["scopes"], query=item["q"], limit=50)
            h = [cid for cid, _, _ in rrf_fuse(v, t, k=50)]
            for method, ids in (("vector", v), ("text", t), ("hybrid", h)):
                for j, value in enumerate(_metrics(_doc_ranking(ids, source_of), item["relevant"])):
                    sums[method][j] += value
    n = len(questions)
    return [Scores(m, n, *(round(x / n, 4) for x in sums[m])) for m in METHODS]
