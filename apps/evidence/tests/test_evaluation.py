"""The retrieval evaluation: its metrics on hand-made rankings, and a run over the project's
labelled questions whose documents are in the test corpus."""

from __future__ import annotations

import pytest

from apps.evidence.evaluation import _metrics, evaluate, questions_load
from tests.conftest import SMALL_KB


def test_the_metrics_on_known_rankings():
    rel = ["kb/public/a.md"]
    assert _metrics(["public/a.md", "public/b.md"], rel) == (1.0, 1.0, 1.0)
    recall, mrr, ndcg = _metrics(["public/b.md", "public/c.md", "public/a.md"], rel)
    assert (recall, mrr) == (1.0, pytest.approx(1 / 3)) and ndcg == pytest.approx(0.5)
    assert _metrics([f"public/x{i}.md" for i in range(5)] + ["public/a.md"], rel)[0] == 0.0, "rank 6 is no hit"
    assert _metrics([], rel) == (0.0, 0.0, 0.0)


def test_the_labelled_set_has_at_least_60_questions_with_reader_scopes():
    items = questions_load()
    assert len(items) >= 60
    assert all(set(i["scopes"]) <= {"public", "tier2", "security"} for i in items)


def test_hybrid_finds_the_answers_in_the_small_corpus_at_least_as_well_as_either_alone(tenant, kb):
    names = {f"kb/{scope}/{name}" for scope, name in SMALL_KB}
    items = [i for i in questions_load() if set(i["relevant"]) <= names]
    assert len(items) >= 6
    scores = {s.method: s for s in evaluate(tenant_id=tenant.pk, questions=items)}
    assert scores["hybrid"].recall_at_5 == 1.0
    assert scores["hybrid"].recall_at_5 >= max(scores["vector"].recall_at_5, scores["text"].recall_at_5)
    for metric in ("mrr", "ndcg_at_10"):  # fusion may trail the better list a little, never the worse
        assert getattr(scores["hybrid"], metric) >= min(getattr(scores["vector"], metric),
                                                        getattr(scores["text"], metric))
