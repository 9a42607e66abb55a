"""The local drafter (apps/llm/drafter.py) in the report's language: a Chinese report is measured
by what its characters say, gets its question in Chinese, and its ticket's own sentences in
Chinese; an English report is drafted exactly as before."""

from __future__ import annotations

import pytest

from apps.llm.drafter import LOCAL_MODEL_ID, local_draft

DEVICE = {"asset_tag": "PRN-0417", "kind": "printer", "site": "HQ-3E", "state": "fault", "criticality": "medium",
          "alert_code": "PRN-JAM-13.B", "alert_message": "Jam at fuser exit", "version": 7}


def _draft(symptom: str, answers=()) -> dict:
    return local_draft(request={"symptom": symptom, "urgency": "high"}, device=DEVICE, evidence=[], tenant="acme",
                       requester="riley", answers=list(answers))


@pytest.mark.parametrize("symptom", ["打印机一直卡纸", "纸卡在定影器出口", "The printer jams at the fuser exit"])
def test_a_whole_report_asks_nothing(symptom):
    assert _draft(symptom)["missing_information"] == []


@pytest.mark.parametrize("symptom, question_starts",
                         [("坏了", "请用一句话描述故障现象"), ("broken", "Describe the symptom")])
def test_a_report_too_short_to_act_on_is_asked_about_in_its_own_language(symptom, question_starts):
    [question] = _draft(symptom)["missing_information"]
    assert question.startswith(question_starts)


def test_an_answer_completes_a_short_chinese_report():
    assert _draft("坏了", answers=["一直卡纸，重启没用"])["missing_information"] == []


def test_the_tickets_own_sentences_follow_the_report():
    zh = _draft("打印机一直卡纸")["ticket"]["description"]
    assert zh.startswith("报告人 riley：打印机一直卡纸") and "读取时的设备状态（对象版本 7）" in zh
    assert "未引用处理规程" in zh
    en = _draft("The printer jams at the fuser exit")["ticket"]["description"]
    assert en.startswith("Reported by riley: The printer jams") and "Device state at read time (object version 7)" in en
    assert "PRN-0417 (printer, HQ-3E) is fault with PRN-JAM-13.B: Jam at fuser exit" in en
    assert _draft("x")["model"] == LOCAL_MODEL_ID == "local-drafter/2"
