"""Guidance a technician can follow, quoted from the selected evidence (DESIGN.md §9).

:func:`guidance_build` reads the cited chunks of the primary procedure and returns what the answer
and the ticket draft say, each part a list of :class:`Quote` — whole lines of a chunk, never cut
mid-word, each with its span (chunk id, version, character range in the chunk's text), so a quote
is an exact substring of the chunk version it cites (faithfulness by construction):

* ``code``: the procedure's own line for the device's alert code (what the code means);
* ``safety``: the safety warnings, first;
* ``steps``: the matching section's steps, whole and in order (steps written only for other codes of
  the alert's family are left out);
* ``escalation``: when to hand it on.

Markdown structure (headings, table separators, a table's header row) is never quoted as a step.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from functools import lru_cache

from apps.evidence.relevance import section_role

#: at most this many steps are quoted (whole, in order); the citation links to the rest
MAX_STEPS = 12
MAX_SAFETY = 4
MAX_ESCALATION = 3

_ITEM = re.compile(r"^\s*(?:\d+[.)]|[-*+])\s+\S")
_TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{2,}")
_WARNING_LEAD = re.compile(
    r"(?:\*\*)?(?:(?:do not|don't|never|warning|caution|danger)\b|不要|切勿|禁止|严禁|警告|注意)", re.I)


@dataclass(frozen=True)
class Quote:
    """``text`` is ``chunk.text[start:end]`` of chunk ``chunk_id`` (document version ``version``)."""

    text: str
    chunk_id: int
    version: int
    start: int
    end: int
    source: str
    section: str

    def as_dict(self) -> dict:
        return asdict(self)


def _lines(text: str):
    """``(start, end, line)`` of each non-empty line of ``text`` (offsets into ``text``)."""
    pos = 0
    for raw in text.split("\n"):
        stripped = raw.strip()
        if stripped:
            lead = len(raw) - len(raw.lstrip())
            yield pos + lead, pos + lead + len(stripped), stripped
        pos += len(raw) + 1


def _quote(ref: dict, start: int, end: int) -> Quote:
    return Quote(text=ref["excerpt"][start:end], chunk_id=ref["chunk_id"], version=ref["version"], start=start,
                 end=end, source=ref["source"], section=ref.get("section", ""))


def _items(ref: dict) -> list[Quote]:
    """The list items (numbered or bulleted) of a chunk, each whole, its marker kept out of the
    quote; a table row is an item when it is not the table's header or separator."""
    out, table_rows = [], 0
    for start, end, line in _lines(ref["excerpt"]):
        if line.startswith("#") or _TABLE_SEPARATOR.match(line):
            continue
        if line.startswith("|"):
            table_rows += 1
            if table_rows == 1:
                continue  # the header row
            out.append(_quote(ref, start, end))
            continue
        m = _ITEM.match(line)
        if m:
            marker = re.match(r"^\s*(?:\d+[.)]|[-*+])\s+", line).end()
            out.append(_quote(ref, start + marker, end))
    return out


def _sentences(ref: dict) -> list[Quote]:
    """The prose lines of a chunk (no heading), each whole."""
    return [_quote(ref, s, e) for s, e, line in _lines(ref["excerpt"]) if not line.startswith("#")]


def code_line(ref: dict, code: str) -> Quote | None:
    """The line of ``ref``'s chunk that defines ``code`` (a list item or table row naming it), else
    None. The quote starts at the code."""
    for start, _end, line in _lines(ref["excerpt"]):
        at = line.upper().find(code.upper())
        if at >= 0 and (line.lstrip("-*+ |").upper().startswith(code.upper()) or line.startswith("|")):
            body = line[at:].rstrip(" |")  # a table row's closing pipe is not part of what it says
            return _quote(ref, start + at, start + at + len(body))
    return None


def for_other_codes(text: str, code: str) -> bool:
    """Whether a step is written for other codes of ``code``'s family only ("For PRN-FUSER-50.1
    and 50.4, ..." under a PRN-FUSER-50.2 alert): it names a sibling code and not ``code``."""
    patterns = _code_patterns(code.upper())
    if patterns is None:
        return False
    own, own_tail, sibling = patterns
    upper = text.upper()
    if own.search(upper) or own_tail.search(upper):
        return False
    return sibling.search(upper) is not None


@lru_cache(maxsize=256)
def _code_patterns(code: str) -> tuple[re.Pattern, re.Pattern, re.Pattern] | None:
    """``(the code itself, its last part alone, any code of its family)`` for an upper-case alert
    code, compiled once per code (a report's steps are each tested against the same code); None for
    a code without a family (no ``-``)."""
    family, _, tail = code.rpartition("-")
    if not family:
        return None
    return (re.compile(rf"(?<![A-Z0-9]){re.escape(code)}(?![A-Z0-9])"),
            re.compile(rf"(?<![A-Z0-9.]){re.escape(tail)}(?![A-Z0-9])"),
            re.compile(rf"(?<![A-Z0-9]){re.escape(family)}-[A-Z0-9.]+"))


def guidance_build(refs: list[dict], *, alert_code: str | None) -> dict:
    """``{"document": {title, version, source, stale, stale_reason} | None, "code": Quote | None,
    "safety": [Quote], "steps": [Quote], "escalation": [Quote]}`` from the references of one
    selection (``EvidenceRef.as_dict()`` shape; ``excerpt`` holds the chunk's whole text). Built
    from the first reference's document (the primary); other documents' references are cited but
    not quoted as steps."""
    if not refs:
        return {"document": None, "code": None, "safety": [], "steps": [], "escalation": []}
    primary = refs[0]["document_id"]
    own = [r for r in refs if r["document_id"] == primary]
    code = None
    if alert_code:
        code = next((q for r in own if (q := code_line(r, alert_code)) is not None), None)
    safety, steps, escalation = [], [], []
    for ref in own:
        role = section_role(ref.get("section", ""))
        if role == "safety":
            safety += _items(ref) or _sentences(ref)
        elif role == "escalation":
            escalation += _items(ref) or _sentences(ref)
        elif role in ("steps", "other") and not steps:
            items = [q for q in _items(ref) if not (alert_code and for_other_codes(q.text, alert_code))]
            # A step that is only a warning ("Do not ...") is shown with the safety warnings; a step
            # that warns on the way ("Raise darkness in steps of 2. Do not exceed 28.") stays a step.
            safety += [q for q in items if _WARNING_LEAD.match(q.text)]
            steps = [q for q in items if not _WARNING_LEAD.match(q.text)] or items
    head = refs[0]
    return {
        "document": {"title": head["document_title"], "version": head["version"], "source": head["source"],
                     "stale": bool(head.get("stale")), "stale_reason": head.get("stale_reason", "")},
        "code": code,
        "safety": _unique(safety)[:MAX_SAFETY],
        "steps": _unique(steps)[:MAX_STEPS],
        "escalation": _unique(escalation)[:MAX_ESCALATION],
    }


def _unique(quotes: list[Quote]) -> list[Quote]:
    seen, out = set(), []
    for q in quotes:
        if (q.chunk_id, q.start) not in seen:
            seen.add((q.chunk_id, q.start))
            out.append(q)
    return out
