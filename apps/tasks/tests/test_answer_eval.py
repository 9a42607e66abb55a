"""The composed-answer eval (apps.tasks.answer_eval) on a fixed slice of the labelled reports:
every quoted span exact and whole, guidance in every answer, clean abstentions, the requester's
language — and the checker itself catches a span that is off by one character."""

from __future__ import annotations

import math

import pytest

from apps.evidence.evaluation import reports_load
from apps.tasks import answer, answer_eval
from apps.tasks.answer import kind_label

#: every third labelled report: all groups, both languages
SLICE = reports_load()[::3]


@pytest.mark.django_db
def test_composed_answers_quote_exact_whole_spans_and_abstain_cleanly(whole_kb):
    checks, totals = answer_eval.answers_evaluate(tenant_id=whole_kb.pk, items=SLICE)
    assert totals["answers"] == len(SLICE) and totals["quotes"] > 3 * len(SLICE)
    assert totals["faithfulness"] == 1.0 and totals["whole_words"] == 1.0 and totals["cited_in_text"] == 1.0
    assert totals["answered_with_steps"] >= 0.95 and totals["code_line"] >= 0.95
    assert totals["language"] == 1.0 and totals["clean_abstentions"] == 1.0
    assert totals["abstained_of_negatives"] >= 0.9
    zh = [c for c in checks if c.id.startswith("zh-") and c.outcome == "answered"]
    assert zh and all("现在怎么做" in c.text for c in zh)


@pytest.mark.django_db
def test_a_quote_off_by_one_character_is_counted_unfaithful(whole_kb, monkeypatch):
    compose = answer.knowledge_compose

    def shifted(state):
        knowledge = compose(state)
        knowledge["quotes"] = [{**q, "start": q["start"] + 1} for q in knowledge["quotes"]]
        return knowledge

    monkeypatch.setattr(answer, "knowledge_compose", shifted)
    item = next(i for i in SLICE if i["group"] == "answerable" and i["language"] == "en")
    check = answer_eval.answer_check(tenant_id=whole_kb.pk, item=item)
    assert check.quotes > 0 and check.faithful == 0


def test_scores_of_nothing_are_not_a_number():
    totals = answer_eval.answer_scores([])
    assert totals["answers"] == 0 and math.isnan(totals["faithfulness"]) and math.isnan(totals["language"])


def test_device_kinds_are_named_in_the_requesters_language():
    assert kind_label("wireless_ap", "en") == "wireless ap"
    assert kind_label("wireless_ap", "zh") == "无线接入点"
    assert kind_label("forklift", "zh") == "forklift" and kind_label(None, "zh") == "设备"
