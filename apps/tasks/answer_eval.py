"""The composed answer, scored on the labelled reports (DESIGN.md §9; spec §16.11 "evaluation").

``apps.evidence.evaluation`` scores *which* procedure a report is given; this module scores *what
the requester reads*: each labelled report is run through the product's relevance check
(:func:`apps.evidence.relevance.evidence_select`) and the answer composer
(:func:`apps.tasks.answer.knowledge_compose`) exactly as the agent runs them, on a state built the
way the reducer builds it from ``evidence.retrieved``, and the answer is checked:

* **faithfulness** — every quoted span is ``chunk.text[start:end]`` of the cited chunk version,
  re-read from the database (not from the answer's own copy), and is cited in the text as ``[n]``;
* **whole words** — no quote starts or ends inside a word;
* **guidance** — an answered report quotes steps; one whose device reports an alert code that the
  procedure lists quotes that code's own line;
* **abstention** — a report answered ``no_procedure`` cites and quotes nothing;
* **language** — the answer's own sentences are in the report's language.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from apps.evidence.evaluation import ABSTAIN_GROUPS, reports_load
from apps.evidence.governance import is_chinese
from apps.evidence.models import Chunk
from apps.evidence.relevance import evidence_select
from apps.tasks import answer

_WORD = re.compile(r"[A-Za-z0-9]")


@dataclass(frozen=True)
class AnswerCheck:
    """What one composed answer held: ``quotes`` quoted spans, ``faithful`` of them exact
    substrings of their cited chunk version, ``whole_words`` of them cut at word boundaries, and
    flags for steps, the code line, the language and a clean abstention."""

    id: str
    group: str
    outcome: str
    quotes: int
    faithful: int
    whole_words: int
    cited_in_text: int
    has_steps: bool
    has_code_line: bool | None  # None: the device reports no code the cited procedure lists
    language_ok: bool
    clean_abstention: bool | None  # None: the report was answered
    text: str


def answer_state(item: dict, selection) -> dict:
    """The reducer's state for ``item`` after ``evidence.retrieved`` with ``selection``: the
    request, the device reading and the recorded refs and selection (as the controller records
    them)."""
    chosen = selection.as_dict()
    chosen.pop("refs")
    device = {"asset_tag": item.get("device", {}).get("asset_tag") or "DEV-1", **item.get("device", {})}
    return {"request": {"symptom": item["report"]}, "answers": [], "device": device,
            "evidence": [r.as_dict() for r in selection.refs], "selection": chosen}


def _cut_inside_word(text: str, start: int, end: int) -> bool:
    before = text[start - 1] if start > 0 else " "
    after = text[end] if end < len(text) else " "
    return bool((_WORD.match(before) and _WORD.match(text[start:start + 1] or " ")) or
                (_WORD.match(after) and _WORD.match(text[end - 1:end] or " ")))


def answer_check(*, tenant_id: int, item: dict) -> AnswerCheck:
    """Compose the answer to labelled ``item`` for a reader of ``tenant_id`` with the item's
    scopes, and check it (see the module docstring)."""
    sel = evidence_select(tenant_id=tenant_id, scopes=item["scopes"], report=item["report"], device=item["device"])
    state = answer_state(item, sel)
    knowledge = answer.knowledge_compose(state)
    texts = dict(Chunk.objects.filter(pk__in=[q["chunk_id"] for q in knowledge["quotes"]])
                 .values_list("pk", "text"))
    versions = {r.chunk_id: r.version for r in sel.refs}
    faithful = whole = cited = 0
    for q in knowledge["quotes"]:
        source = texts.get(q["chunk_id"], "")
        if source[q["start"]:q["end"]] == q["text"] and versions.get(q["chunk_id"]) == q["version"] and q["text"]:
            faithful += 1
        if not _cut_inside_word(source, q["start"], q["end"]):
            whole += 1
        if f"“{q['text']}” [{q['n']}]" in knowledge["text"]:
            cited += 1
    alert = (item["device"].get("alert_code") or "").upper()
    # The code line is due when the procedure the answer is built from lists the device's code.
    primary = sel.refs[0].document_id if sel.refs else None
    listed = bool(alert) and any(alert in (r.excerpt or "").upper() for r in sel.refs if r.document_id == primary)
    code_line = any(alert in q["text"].upper() for q in knowledge["quotes"]) if listed else None
    steps = "  1. " in knowledge["text"]
    # The answer's own sentences (the text without its quotes) are in the report's language.
    own_words = re.sub(r"“[^”]*”", "", knowledge["text"])
    language_ok = knowledge["language"] == ("zh" if item.get("language") == "zh" else "en") and \
        is_chinese(own_words) == (item.get("language") == "zh")
    clean = None if sel.outcome == "answered" else (knowledge["citations"] == [] and knowledge["quotes"] == [])
    return AnswerCheck(item["id"], item["group"], sel.outcome, len(knowledge["quotes"]), faithful, whole, cited,
                       steps, code_line, language_ok, clean, knowledge["text"])


def answer_scores(checks: list[AnswerCheck]) -> dict:
    """Totals over ``checks``: ``quotes``, ``faithfulness`` and ``whole_words`` (shares of all
    quoted spans), ``cited_in_text``, ``answered_with_steps`` and ``code_line`` (shares of the
    answered reports they apply to), ``language`` (share of all answers) and
    ``clean_abstentions`` (share of the abstentions). A share with nothing to count is NaN."""
    nan = float("nan")
    quotes = sum(c.quotes for c in checks)
    answered = [c for c in checks if c.outcome == "answered"]
    coded = [c for c in answered if c.has_code_line is not None]
    abstained = [c for c in checks if c.clean_abstention is not None]

    def share(n: int, d: int) -> float:
        return round(n / d, 4) if d else nan

    return {
        "answers": len(checks),
        "quotes": quotes,
        "faithfulness": share(sum(c.faithful for c in checks), quotes),
        "whole_words": share(sum(c.whole_words for c in checks), quotes),
        "cited_in_text": share(sum(c.cited_in_text for c in checks), quotes),
        "answered_with_steps": share(sum(c.has_steps for c in answered), len(answered)),
        "code_line": share(sum(bool(c.has_code_line) for c in coded), len(coded)),
        "language": share(sum(c.language_ok for c in checks), len(checks)),
        "clean_abstentions": share(sum(bool(c.clean_abstention) for c in abstained), len(abstained)),
        "abstained_of_negatives": share(sum(c.outcome == "no_procedure" for c in checks if c.group in ABSTAIN_GROUPS),
                                        sum(c.group in ABSTAIN_GROUPS for c in checks)),
    }


def answers_evaluate(*, tenant_id: int, items: list[dict] | None = None) -> tuple[list[AnswerCheck], dict]:
    """Check the answer to every labelled report (default: :func:`reports_load`)."""
    checks = [answer_check(tenant_id=tenant_id, item=item) for item in (items or reports_load())]
    return checks, answer_scores(checks)
