"""Retrieval evaluation: a labelled question set over the project's knowledge base,
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
from apps.evidence.models import Chunk, Document
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


# --- the report eval: relevance, abstention and the composed answer ----------------------------

EVAL_DIR = Path(__file__).resolve().parent / "eval"
#: groups whose reports should be answered, and those that should be told "nothing covers this"
ANSWER_GROUPS = ("answerable", "answerable_other_alert", "answerable_zh", "answerable_zh_other_alert", "stale_only")
ABSTAIN_GROUPS = ("not_permitted", "unanswerable")


def eval_tenant(slug: str, *, kb_dir: Path, write=print):
    """The tenant whose corpus an eval scores. ``"eval"`` is created when missing and (re)ingested
    from ``kb_dir`` (one folder per scope; unchanged documents cost nothing), writing one line per
    scope; any other slug must exist. Raises ``CommandError`` for an unknown tenant."""
    from django.core.management.base import CommandError

    from apps.accounts.models import AccessScope, Tenant
    from apps.evidence.services import path_ingest

    t = Tenant.objects.filter(slug=slug).first()
    if t is None:
        if slug != "eval":
            raise CommandError(f"no tenant {slug!r}")
        t = Tenant.objects.create(slug="eval", name="Retrieval evaluation")
    if slug == "eval":
        for scope in AccessScope.values:
            report = path_ingest(tenant=t, path=kb_dir / scope, scope=scope)
            write(f"corpus {scope}: {report.created} created, {report.updated} updated, {report.unchanged} unchanged")
    return t


def reports_load(directory: Path = EVAL_DIR) -> list[dict]:
    """The labelled reports of every ``reports*.json`` in ``directory``: ``[{"id", "group",
    "report", "language", "device": {...}, "scopes", "relevant": [source], "expect"}]``. Raises
    ``ValueError`` for a malformed entry or a repeated id."""
    items, seen = [], set()
    for path in sorted(directory.glob("reports*.json")):
        for i, item in enumerate(json.loads(path.read_text(encoding="utf-8"))):
            if not (isinstance(item.get("report"), str) and item.get("group") and isinstance(item.get("scopes"), list)
                    and item.get("expect") in ("answer", "abstain") and isinstance(item.get("device"), dict)):
                raise ValueError(f"{path.name} entry {i}: needs report, group, device, scopes and expect")
            if item["id"] in seen:
                raise ValueError(f"{path.name}: id {item['id']} repeated")
            seen.add(item["id"])
            items.append(item)
    return items


@dataclass(frozen=True)
class ReportOutcome:
    """What the product did with one labelled report."""

    id: str
    group: str
    expect: str
    outcome: str
    documents: list[str]
    first_relevant_rank: int | None
    stale_marked: bool
    ranking_rank: int | None  # the first relevant document's rank among the candidates before abstention
    signals: dict


def report_run(*, tenant_id: int, item: dict) -> ReportOutcome:
    """Run :func:`apps.evidence.relevance.evidence_select` on one labelled report."""
    from apps.evidence.relevance import evidence_select

    sel = evidence_select(tenant_id=tenant_id, scopes=item["scopes"], report=item["report"], device=item["device"])
    return report_outcome(item, sel)


def report_outcome(item: dict, sel) -> ReportOutcome:
    """What ``sel`` (a :class:`~apps.evidence.relevance.Selection`) did with labelled ``item``."""
    docs = list(dict.fromkeys(r.source for r in sel.refs))
    relevant = item.get("relevant") or []
    rank = next((i for i, src in enumerate(docs, start=1) if any(_matches(src, r) for r in relevant)), None)
    ids = list(sel.signals.get("ranking") or [])
    sources = dict(Document.objects.filter(pk__in=ids).values_list("pk", "source"))
    ranked = [sources.get(i, "") for i in ids]
    before = next((i for i, src in enumerate(ranked, start=1) if any(_matches(src, r) for r in relevant)), None)
    return ReportOutcome(item["id"], item["group"], item["expect"], sel.outcome, docs, rank,
                         any(r.stale for r in sel.refs), sel.signals, before)


@dataclass(frozen=True)
class GroupScores:
    """Per-group figures: recall@1, recall@5 and MRR over the answerable reports (an abstention
    counts as a miss), and the share of reports handled as expected (answered, or abstained)."""

    group: str
    n: int
    recall_at_1: float
    recall_at_5: float
    mrr: float
    as_expected: float
    ranking_recall_at_5: float  # the right document among the first five candidates, before abstention


def report_scores(outcomes: list[ReportOutcome]) -> tuple[list[GroupScores], dict]:
    """``(per-group scores, totals)``; totals hold abstention precision and recall (an abstention
    is positive), the answered share of the answerable reports, and the stale-mark rate."""
    groups: dict[str, list[ReportOutcome]] = {}
    for o in outcomes:
        groups.setdefault(o.group, []).append(o)
    rows = []
    for group, items in sorted(groups.items()):
        n = len(items)
        expected = sum((o.outcome == "no_procedure") == (o.expect == "abstain") for o in items) / n
        if items[0].expect == "answer":
            r1 = sum(o.first_relevant_rank == 1 and o.outcome == "answered" for o in items) / n
            r5 = sum(o.first_relevant_rank is not None and o.first_relevant_rank <= 5 for o in items) / n
            mrr = sum(1 / o.first_relevant_rank for o in items if o.first_relevant_rank) / n
            ranking5 = sum(o.ranking_rank is not None for o in items) / n
        else:
            r1 = r5 = mrr = ranking5 = float("nan")
        rows.append(GroupScores(group, n, round(r1, 4), round(r5, 4), round(mrr, 4), round(expected, 4),
                                round(ranking5, 4)))
    abstained = [o for o in outcomes if o.outcome == "no_procedure"]
    should = [o for o in outcomes if o.expect == "abstain"]
    answerable = [o for o in outcomes if o.expect == "answer"]
    stale = [o for o in outcomes if o.group == "stale_only" and o.outcome == "answered"]
    totals = {
        "abstention_precision": round(sum(o.expect == "abstain" for o in abstained) / len(abstained), 4)
        if abstained else float("nan"),
        "abstention_recall": round(sum(o.outcome == "no_procedure" for o in should) / len(should), 4)
        if should else float("nan"),
        "answered_of_answerable": round(sum(o.outcome == "answered" for o in answerable) / len(answerable), 4)
        if answerable else float("nan"),
        "stale_marked": round(sum(o.stale_marked for o in stale) / len(stale), 4) if stale else float("nan"),
    }
    return rows, totals
