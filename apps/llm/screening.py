"""Screening what a model writes in a ticket's describing fields (spec §16.6 "模型只提出", §16.9;
DESIGN.md §9): the title and the description are the model's words, kept — but a sentence that no
recorded input supports is dropped, and text that reads as instructions is flagged.

Support is checked the way the answer's quotes are (apps/tasks/answer_eval.py: a quote must be a
span of the text it cites), relaxed from characters to words because a model paraphrases: a
sentence is supported when it is a span of an input, or when its content words are found in the
inputs (the report, the requester's answers, the attached logs' lines, the device reading and the
retrieved evidence). Every number and code in it (``E-203``, ``42``, ``v2.1``) must be found
verbatim — an invented error code or firmware version is the most harmful kind of made-up claim —
and at most one other content word, and at most a third of them, may be missing. Words that only
frame a report (``requester``, ``reported``, ``device``, ``ticket``, …) count as found. Chinese
text is compared by its two-character words (bigrams).

Pure functions over strings; nothing here reads the database.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from apps.evidence.guard import injection_flags, readable_text

#: words that describe a report or a ticket rather than claim anything about the fault
FRAME_WORDS = frozenset("""
a an the and or but of to in on at for from with by as is are was were be been being it its this that these
those there here has have had do does did not no yes can could should would will may might must shall also
then than so such very more most less some any all each both either neither other another again further
into onto over under about after before during since until while when where which who whom whose what why how
i we you he she they them their our your my me us his her him
requester reporter user users customer reported reports report reporting says said states stated describes
described mentions mentioned notes noted asks asked according
device devices asset ticket tickets issue issues problem problems fault faults error errors symptom symptoms
please check checked follow following steps step procedure procedures documented documentation cited
evidence described description title priority urgent urgency technician technicians site state status
alert alerts current currently observed seen shows showing see attached attachment log logs line lines
""".split())

#: a sentence ends at . ! ? (not a dot inside a code or a number, ``50.2``, ``v2.1``), 。！？ or a line end
_SENTENCE = re.compile(r"(?:[^.!?。！？\n]|[.!?](?=[^\s.!?]))+[.!?。！？]*", re.UNICODE)
_LATIN = re.compile(r"[A-Za-z][A-Za-z'’-]+")
_LATIN_WORDS = re.compile(r"[A-Za-z][A-Za-z'’]*")
#: a code or number: ASCII letters and digits with ``- _ .`` inside, holding a digit. Bounded by
#: anything but an ASCII letter or digit — Chinese text around it included ("代码E999，"), which
#: ``\b`` would count as part of the word.
_CODE = re.compile(r"(?<![A-Za-z0-9])(?=[A-Za-z0-9._-]*\d)[A-Za-z]*[-_.]?\d[A-Za-z0-9._-]*(?![A-Za-z0-9])")
#: words that turn a statement around; each must be found in the inputs together with the word
#: it governs ("do not open" is not supported by "open tray 2")
_NEGATIONS = frozenset({"not", "no", "never", "don't", "dont", "doesn't", "cannot", "can't", "without", "nor",
                        "neither", "none", "nothing", "won't", "isn't", "aren't", "shouldn't", "mustn't",
                        "avoid", "stop"})
_CJK_NEGATIONS = "不没無无勿别未非禁"
_CJK = re.compile(r"[\u2e80-\u9fff]+")
_SUFFIXES = ("ations", "ation", "ings", "ing", "edly", "ed", "es", "ly", "er", "s")


def _stem(word: str) -> str:
    word = word.lower().replace("’", "'").strip("'-")
    for suffix in _SUFFIXES:
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            return word[: -len(suffix)]
    return word


def _codes(text: str) -> set[str]:
    return {c.lower().strip(".-_") for c in _CODE.findall(text)}


def _negated(text: str) -> set[str]:
    """Each negation with the content word it governs: ``"not open"`` for "Do not open tray 2"
    (Latin: the next word of three letters or more, stemmed), and each Chinese two-character word
    that starts with a negation (``不要``, ``未定``)."""
    out = set()
    words = [w.lower().replace("’", "'") for w in _LATIN_WORDS.findall(text)]
    for i, w in enumerate(words):
        if w in _NEGATIONS:
            nxt = next((x for x in words[i + 1:i + 4] if len(x) > 2 and x not in FRAME_WORDS), None)
            out.add(f"{w} {_stem(nxt) if nxt else ''}".strip())
    for run in _CJK.findall(text):
        out.update(run[i:i + 2] for i in range(len(run)) if run[i] in _CJK_NEGATIONS)
    return out


def _readable(text: str) -> str:
    """NFKC (full-width, circled and superscript digits become plain ones), invisible format
    characters removed — the form both a sentence and its sources are compared in."""
    return readable_text(text)


def _bigrams(text: str) -> set[str]:
    out: set[str] = set()
    for run in _CJK.findall(text):
        out.update(run[i:i + 2] for i in range(len(run) - 1))
        if len(run) == 1:
            out.add(run)
    return out


@dataclass(frozen=True)
class Sources:
    """The recorded inputs a description may draw on, indexed for :func:`sentence_supported`."""

    text: str
    stems: frozenset[str] = field(default_factory=frozenset)
    codes: frozenset[str] = field(default_factory=frozenset)
    bigrams: frozenset[str] = field(default_factory=frozenset)
    negated: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, texts) -> Sources:
        """Index ``texts`` (strings; None and non-strings are skipped)."""
        joined = _readable("\n".join(t for t in texts if isinstance(t, str) and t))
        return cls(text=" ".join(joined.lower().split()),
                   stems=frozenset(_stem(w) for w in _LATIN.findall(joined)),
                   codes=frozenset(_codes(joined)), bigrams=frozenset(_bigrams(joined)),
                   negated=frozenset(_negated(joined)))


def state_sources(state: dict) -> Sources:
    """The inputs recorded in a task's ``state`` that a draft may draw on: the request (symptom,
    urgency, attachments' names and log lines), the requester's answers, the device reading's
    fields and the retrieved evidence's titles, sections and excerpts."""
    request = state.get("request") or {}
    device = state.get("device") or {}
    texts = [request.get("symptom"), request.get("urgency"), *(state.get("answers") or [])]
    for a in request.get("attachments") or []:
        texts += [a.get("name"), a.get("text")]
    # the reading's fields, but not its bookkeeping: the object version and the row id are not
    # facts about the fault ("for 17 days" must not pass because the device is at version 17)
    texts += [str(v) for k, v in device.items()
              if k not in ("version", "device_id") and v is not None and not isinstance(v, dict | list)]
    for e in state.get("evidence") or []:
        texts += [e.get("document_title"), e.get("section"), e.get("excerpt"), e.get("source")]
    if state.get("ticket"):
        texts += [str(state["ticket"].get("external_id")), state["ticket"].get("title")]
    return Sources.of(texts)


def sentence_supported(sentence: str, sources: Sources) -> bool:
    """Is ``sentence`` supported by ``sources``? A span of them is; otherwise every number and code
    in it must be found verbatim, so must each negation with the word it governs, at most one content
    word (and at most a third of them) may be missing, and — for Chinese — at least two thirds of
    its two-character words must be found. Both sides are compared as :func:`_readable` shows them."""
    sentence = _readable(sentence)
    norm = " ".join(sentence.lower().split()).strip(" .!?。！？")
    if not norm or norm in sources.text:
        return True
    if _codes(sentence) - sources.codes or _negated(sentence) - sources.negated:
        return False
    words = [w for w in (_stem(x) for x in _LATIN.findall(sentence)) if w not in FRAME_WORDS and len(w) > 2]
    missing = [w for w in words if w not in sources.stems and w not in {_stem(f) for f in FRAME_WORDS}]
    if words and (len(missing) > 1 or len(missing) * 3 > len(words)):
        return False
    grams = _bigrams(sentence)
    if grams:
        found = len(grams & sources.bigrams)
        if found * 3 < len(grams) * 2:
            return False
    return True


def sentences(text: str) -> list[str]:
    """``text`` cut into sentences (at ``. ! ? 。 ！ ？`` and line ends; a dot inside a code or a
    number does not end one), each stripped, none empty."""
    return [s.strip() for s in _SENTENCE.findall(text or "") if s.strip()]


def description_screen(text: str, sources: Sources) -> tuple[str, list[str]]:
    """``(kept, dropped)``: ``text`` without the sentences ``sources`` do not support (the rest as
    written, one line per line of ``text``), and the dropped sentences in order."""
    kept_lines, dropped = [], []
    for line in (text or "").split("\n"):
        keep = []
        for s in sentences(line):
            (keep if sentence_supported(s, sources) else dropped).append(s)
        if keep or not line.strip():
            kept_lines.append(" ".join(keep))
    kept = re.sub(r"\n{3,}", "\n\n", "\n".join(kept_lines)).strip()
    return kept, dropped


def instruction_flags(fields: dict[str, str]) -> list[dict]:
    """``[{"source": "model <field>", "flags": [...]}]`` for each of ``fields`` (name -> text the
    model wrote) that reads like an instruction to an agent (apps.evidence.guard)."""
    return [{"source": f"model {name}", "flags": flags}
            for name, text in fields.items() if (flags := injection_flags(text or ""))]
