"""Relevant evidence or an honest "nothing covers this" (DESIGN.md §9; spec §16.6).

:func:`evidence_select` answers one question for a task: which procedures bear on *this device*
and *this report*, and if none the reader may read does, say so. It uses what separates evidence
from text that merely resembles it:

* **what a document applies to** — its ``device_kinds`` and ``alert_codes`` (governance metadata).
  A document written for other kinds of device is not a candidate; one that names no kind is, on
  similarity alone;
* **exact alert codes** — the device's current code, and any code the report itself names ("error
  50.2" for a printer whose documents list ``PRN-FUSER-50.2``);
* **raw similarity** of the report to each candidate chunk (cosine of the embeddings, not the
  fused rank, which says nothing about relevance), helped by the full-text leg;
* **how specific the report is** — its similarity to a set of generic complaints ("it is broken
  and shows an error"). A vague report is about the device's current alert; a specific report that
  matches nothing is about something no procedure covers;
* **a count-only check** of the scopes the reader lacks: whether a document there covers the
  report. Only the count and the scope's name are recorded, never its content.

The report and the device's alert are matched separately and combined so that neither drowns the
other: the alert's document wins when the report is vague or fits it about as well as the best
match; a report about another fault than the current alert finds its own procedure.

The result is recorded with ``evidence.retrieved``: the cited chunks (at most two per document, up
to four of a primary document the report is plainly about), the outcome (``answered`` or
``no_procedure``), why, and the signals it was decided on — so an admin can see the operating
point on the trace. Thresholds are calibrated on the labelled eval (``manage.py eval_retrieval``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime

from django.db import connection, transaction
from django.utils import timezone

from apps.core import sql
from apps.evidence.embedding import embed_query, model_configured
from apps.evidence.governance import evidence_standing, is_chinese
from apps.evidence.models import Chunk
from apps.evidence.report_signals import (
    excluded_subject,
    has_content,
    names_alert_subject,
    report_codes,
    topic_similarity,
    vagueness,
)
from apps.evidence.selectors import _IN_FORCE, _PERMITTED, EvidenceRef, text_candidates, vector_literal

#: Characters of a report matched against the documents (the rest is kept in the task, not matched).
MAX_REPORT_CHARS = 4000
#: A report vague by its words is still about another procedure than the alert's when it fits that
#: one at least this much better ("漏水告警响了，地板下面有水" under a temperature alert).
VAGUE_OVERRIDE = 0.15

#: A report whose best similarity to a candidate chunk is below this is about something the
#: candidates do not cover (unless it is vague and the device's alert is covered).
#: Calibrated on the repo's eval with use-multilingual-v3 (``manage.py eval_retrieval --sweep``).
MIN_SIMILARITY = 0.24
#: For Chinese reports (cross-lingual matches score lower).
MIN_SIMILARITY_ZH = 0.24
#: The alert's document is preferred while the report fits it within this much of the best match.
ALERT_MARGIN = 0.0
#: A report at least this similar to a generic complaint is vague: it is about the current alert.
VAGUE_SIMILARITY = 0.45
#: A document in a scope the reader lacks that fits the report at least about as well as the best
#: readable one (no more than this much less) means the readable ones do not cover it.
WITHHELD_MARGIN = -0.08
#: The full-text leg's vote: a document whose best chunk is the ``r``-th full-text match gets
#: ``TEXT_WEIGHT / (r + TEXT_OFFSET)`` added to its similarity (reciprocal-rank fusion, weighted
#: so that words the report shares with a procedure break near-ties of the embedding, never
#: outweigh a clear difference).
TEXT_WEIGHT = 0.05
TEXT_OFFSET = 2
#: Added to the similarity of a document in another language than the report: the multilingual
#: embedding scores a translation lower than a paraphrase in the same language, so a Chinese report
#: would otherwise prefer any Chinese procedure to the English one that covers it.
CROSS_LINGUAL_BONUS = 0.05
#: A chunk among this many first full-text matches ties the report to its procedure (the
#: out-of-scope check does not override it).
TEXT_DEPTH = 3
#: Another document is cited beside the primary one only when it fits the report within this much.
SECONDARY_MARGIN = 0.08
#: A later steps section is quoted instead of the first one only when it fits this much better.
STEP_MARGIN = 0.05
#: Chunks of one document among the citations (more for a primary document the report names).
PER_DOCUMENT = 2
PER_PRIMARY = 4

#: The report must be this much closer to an excluded topic than to the best procedure to be called
#: out of scope.
OUT_OF_SCOPE_MARGIN = -0.04

#: Section roles by heading words (English and Chinese)
_ROLES = (
    ("codes", re.compile(r"alert code|error code|codes\b|告警代码|报警代码|错误代码|代码", re.I)),
    ("safety", re.compile(r"safety|warning|安全|注意事项|警告", re.I)),
    ("escalation", re.compile(r"escalat|升级|上报", re.I)),
    ("ticket", re.compile(r"ticket|工单", re.I)),
    ("steps", re.compile(r"procedure|diagnos|response|recover|steps|fix|repair|restore|clear|replace|"
                         r"处理|步骤|诊断|处置|恢复|排查|更换|清除|响应|程序", re.I)),
)


def section_role(section: str) -> str:
    """The role of a section by its heading: ``codes``, ``safety``, ``escalation``, ``ticket``,
    ``steps`` or ``other``."""
    for role, rx in _ROLES:
        if rx.search(section or ""):
            return role
    return "other"


@dataclass
class _Doc:
    document_id: int
    doc_id: str
    locale: str
    scope: str
    kinds: list[str]
    codes: list[str]
    title: str = ""
    chunks: dict[int, float] = field(default_factory=dict)  # chunk id -> cosine to the report
    text_rank: int | None = None
    cross_lingual: bool = False  # written in another language than the report
    alert_hit: bool = False
    report_code: str | None = None

    @property
    def similarity(self) -> float:
        best = max(self.chunks.values(), default=0.0)
        return best + (TEXT_WEIGHT / (self.text_rank + TEXT_OFFSET) if self.text_rank is not None else 0.0) + \
            (CROSS_LINGUAL_BONUS if self.cross_lingual else 0.0)


@dataclass(frozen=True)
class Selection:
    """What :func:`evidence_select` decided.

    ``outcome``: ``"answered"`` (``refs`` bear on the report) or ``"no_procedure"`` (``refs`` is
    empty). ``reason``: one sentence for the requester, the approver and the trace. ``primary``:
    ``{"document_id", "doc_id", "source", "title", "locale", "why"}`` of the document the answer
    is built from, or None. ``withheld``: ``{"documents": n, "scopes": [..]}``, a count of
    documents in scopes the reader lacks that would cover the report (never their content).
    ``signals``: the figures the decision was made on (similarities, thresholds, flags).
    """

    outcome: str
    refs: list[EvidenceRef]
    reason: str
    primary: dict | None
    withheld: dict
    signals: dict
    query: dict

    def as_dict(self) -> dict:
        d = asdict(self)
        d["refs"] = [r.as_dict() for r in self.refs]
        return d

    def recorded(self) -> tuple[list[dict], dict]:
        """``(refs, selection)`` as ``evidence.retrieved`` records them: the references as dicts,
        and the decision's other fields (:meth:`as_dict` without ``refs``)."""
        chosen = self.as_dict()
        return chosen.pop("refs"), chosen


_CANDIDATE_SQL = f"""
SELECT c.id, d.id, d.doc_id, c.locale, c.scope, c.device_kinds, c.alert_codes, d.title,
       CASE WHEN c.embedding_model = %(emodel)s THEN 1 - (c.embedding <=> %(qvec)s::vector) ELSE 0 END
FROM evidence_chunk c
JOIN evidence_documentversion v ON v.id = c.document_version_id
JOIN evidence_document d ON d.id = v.document_id
WHERE {_PERMITTED}
  AND (%(kind)s::text IS NULL OR %(kind)s = ANY(c.device_kinds) OR c.device_kinds = '{{}}')
"""  # noqa: S608 - constant fragments; every value is a bound parameter

#: Chunks in force in scopes the reader lacks whose document applies to the device (count-only check).
_WITHHELD_SQL = f"""
SELECT c.scope, d.id,
       max(CASE WHEN c.embedding_model = %(emodel)s THEN 1 - (c.embedding <=> %(qvec)s::vector) ELSE 0 END),
       bool_or(%(code)s::text IS NOT NULL AND %(code)s = ANY(c.alert_codes)),
       array_agg(DISTINCT code) FILTER (WHERE code IS NOT NULL), nullif(d.doc_id, '')
FROM evidence_chunk c
JOIN evidence_documentversion v ON v.id = c.document_version_id
JOIN evidence_document d ON d.id = v.document_id
LEFT JOIN LATERAL unnest(c.alert_codes) AS code ON true
WHERE c.tenant_id = %(tenant)s AND NOT (c.scope = ANY(%(scopes)s)) AND {_IN_FORCE}
  AND (%(kind)s::text IS NULL OR %(kind)s = ANY(c.device_kinds) OR c.device_kinds = '{{}}')
GROUP BY c.scope, d.id, d.doc_id
"""  # noqa: S608 - constant fragments; every value is a bound parameter

def evidence_select(
    *, tenant_id: int, scopes, report: str, device: dict | None, k: int = 5, now: datetime | None = None,
    model: str | None = None,
) -> Selection:
    """Select the evidence that bears on ``report`` about ``device`` for a reader of ``tenant_id``
    with ``scopes``, or decide that nothing the reader may read covers it.

    ``report``: what the requester wrote (and answered since). ``device``: the device reading
    (``kind``, ``alert_code``, ``alert_message``...; None when there is no device). ``model``: the
    embedding model (the task's pinned one; default the configured one). Returns a
    :class:`Selection` with at most ``k`` references, best first. Reads in one transaction; embeds
    the report once."""
    now = now or timezone.now()
    device = device if isinstance(device, dict) else {}
    kind = _clean(device.get("kind"), 64).lower() or None
    alert = _clean(device.get("alert_code"), 64).upper() or None
    message = _clean(device.get("alert_message"), 500)
    report = _clean(report, MAX_REPORT_CHARS)
    query = {"report": report, "device_kind": kind, "alert_code": alert, "alert_message": message}
    scopes = [sc for sc in (scopes or []) if isinstance(sc, str)]
    chinese = is_chinese(report)
    if not scopes:
        return _nothing(query, "no_procedure", "You may read no procedures in this tenant.", {},
                        {"abstention": "no_scopes"})
    if not has_content(report):
        report = ""  # "help", "???", emoji: it says nothing the documents could match
        if alert is None:
            return _nothing(query, "no_procedure", "The report does not say what is wrong and the device reports "
                            "no alert code, so no procedure can be chosen; a person will ask.", {},
                            {"abstention": "no_content"})
    text = report or " ".join(p for p in (kind, alert, message) if p)
    model = model or model_configured()
    q = embed_query(text, model=model)
    qvec = vector_literal(q)
    params = {"tenant": tenant_id, "scopes": scopes, "qvec": qvec, "kind": kind, "now": now, "code": alert,
              "emodel": model}
    docs: dict[int, _Doc] = {}
    with transaction.atomic(), connection.cursor() as cur:
        sql.execute_unprepared(cur, _CANDIDATE_SQL, params)
        for cid, did, doc_id, locale, scope, kinds, codes, title, cos in cur.fetchall():
            # A document that names no device kind is a candidate for a device on similarity alone.
            codes = list(codes) if kinds or kind is None else []
            d = docs.setdefault(did, _Doc(did, doc_id, locale, scope, list(kinds), codes, title))
            d.chunks[cid] = float(cos)
        text_ids = text_candidates(cur, tenant_id=tenant_id, scopes=scopes, query=text, limit=50, now=now) \
            if report else []
        sql.execute_unprepared(cur, _WITHHELD_SQL, params)
        withheld_rows = cur.fetchall()
    chunk_doc = {cid: d for d in docs.values() for cid in d.chunks}
    for rank, cid in enumerate(text_ids, start=1):
        d = chunk_doc.get(cid)
        if d is not None and d.text_rank is None:
            d.text_rank = rank
    hidden = [(scope, did, float(cos or 0.0), bool(hit), set(codes or ()), doc_id or did)
              for scope, did, cos, hit, codes, doc_id in withheld_rows]
    readable_codes = {c for d in docs.values() for c in d.codes}
    named = report_codes(report, readable_codes | {c for h in hidden for c in h[4]})
    for d in docs.values():
        d.alert_hit = alert is not None and alert in d.codes
        hit = named & set(d.codes)
        d.report_code = sorted(hit)[0] if hit else None
    # One language per document: a translation stands in for its original in the report's language.
    docs = _one_locale_each(docs, "zh-CN" if chinese else "en")
    for d in docs.values():
        d.cross_lingual = (d.locale == "zh-CN") != chinese
    vague_by = vagueness(q, model=model) if report else 1.0
    # The report names the subject of the device's own alert code ("a fuser error" under
    # PRN-FUSER-50.2): it is about that alert, even when another procedure resembles its words more.
    agreement = names_alert_subject(report, alert)
    oos = topic_similarity(q, model=model) if report else 0.0
    threshold = MIN_SIMILARITY_ZH if chinese else MIN_SIMILARITY
    ranked = sorted(docs.values(), key=lambda d: (-d.similarity, d.document_id))
    best = ranked[0] if ranked else None
    best_sim = best.similarity if best else 0.0
    alert_doc = next((d for d in ranked if d.alert_hit), None)
    vague = not report or (vague_by >= VAGUE_SIMILARITY and not (
        alert_doc is not None and best is not alert_doc and best_sim >= alert_doc.similarity + VAGUE_OVERRIDE))
    named_doc = next((d for d in ranked if d.report_code), None)
    # The count-only check: documents in scopes the reader lacks that cover this report better.
    best_raw = max(best.chunks.values(), default=0.0) if best else 0.0
    covering = [h for h in hidden if (named & h[4]) or (h[3] and (vague or h[2] >= best_raw))
                or (h[2] >= threshold and h[2] >= best_raw + WITHHELD_MARGIN)]
    withheld = {"documents": len({h[5] for h in covering}), "scopes": sorted({h[0] for h in covering})}
    signals = {
        "best_similarity": round(best_sim, 4) if best else None,
        "alert_similarity": round(alert_doc.similarity, 4) if alert_doc else None,
        "withheld_similarity": round(max((h[2] for h in hidden), default=0.0), 4),
        "vagueness": round(vague_by, 4), "threshold": threshold, "alert_margin": ALERT_MARGIN,
        "withheld_margin": WITHHELD_MARGIN, "vague_threshold": VAGUE_SIMILARITY, "candidates": len(docs),
        "chinese": chinese, "report_codes": sorted(named & readable_codes),
        "second_similarity": round(ranked[1].similarity, 4) if len(ranked) > 1 else None,
        "best_text_rank": best.text_rank if best else None,
        "best_raw": round(best_raw, 4) if best else None,
        "out_of_scope": round(oos, 4), "out_of_scope_margin": OUT_OF_SCOPE_MARGIN,
        "names_alert_subject": agreement,
        # The candidates by fused similarity before any abstention (document ids, best first).
        "ranking": [d.document_id for d in ranked[:5]],
    }
    primary, why = None, ""
    if named_doc is not None:
        primary, why = named_doc, f"the report names {named_doc.report_code}"
    elif withheld["documents"] and (named or not (alert_doc and vague)):
        primary = None  # what covers the report is in a scope the reader lacks
    elif alert_doc is not None and (vague or (alert_doc.similarity >= threshold and (
            alert_doc.similarity >= best_sim - ALERT_MARGIN or agreement))):
        primary, why = alert_doc, f"the device reports {alert}, which it covers"
    elif best is not None and best_sim >= threshold:
        primary, why = best, "it matches the report best"
    # A report the full-text leg ties to the chosen procedure (among its first matches) is about it.
    out_of_scope = primary is not None and not primary.report_code and not vague and \
        (primary.text_rank is None or primary.text_rank > TEXT_DEPTH) and \
        oos >= max(primary.chunks.values(), default=0.0) + OUT_OF_SCOPE_MARGIN
    excluded = None
    if primary is not None and not out_of_scope and not primary.report_code and report:
        excluded = excluded_subject(
            report, kind=kind,
            title=primary.title or "",
            body=lambda: " ".join(Chunk.objects.filter(pk__in=list(primary.chunks)).values_list("text", flat=True)))
        out_of_scope = excluded is not None
    signals["excluded_subject"] = excluded
    if out_of_scope:
        primary = None
    if primary is None:
        # The subject is the code the report names when the reader may read it, else the alert's
        # code unless the report names another one (a hidden code is never spelled out).
        subject_code = min(named & readable_codes, default=None) or (None if named else alert)
        subject = _subject(subject_code, kind)
        signals["subject_code"] = subject_code
        signals["abstention"] = "out_of_scope" if out_of_scope else "withheld" if withheld["documents"] \
            else "uncovered"
        if out_of_scope:
            reason = (f"No procedure in the knowledge base covers this report: it reads as being about something "
                      f"other than the {(kind or 'device').replace('_', ' ')}'s faults, which the maintenance "
                      "procedures do not cover.")
        elif withheld["documents"]:
            reason = (f"No procedure you may read covers {subject}; a procedure in a scope you cannot read "
                      f"({', '.join(withheld['scopes'])}) covers it, and the {' and '.join(withheld['scopes'])} "
                      "team holds it.")
        else:
            reason = f"No procedure in the knowledge base covers {subject} as reported."
        return _nothing(query, "no_procedure", reason, withheld, signals)
    refs = _citations(primary, ranked, threshold=threshold, k=k, now=now,
                      vague=vague, alert=primary.report_code or (alert if primary.alert_hit else None),
                      decisive=bool(primary.report_code or primary.alert_hit))
    doc = refs[0]
    return Selection(
        outcome="answered", refs=refs,
        reason=f"{doc.document_title} v{doc.version} bears on this report: {why}.",
        primary={"document_id": primary.document_id, "doc_id": primary.doc_id, "source": doc.source,
                 "title": doc.document_title, "locale": primary.locale, "why": why},
        withheld=withheld, signals=signals, query=query,
    )


def _clean(value, limit: int) -> str:
    """``value`` as text a query can carry: a string (anything else is ignored), without NUL or
    unpaired surrogates, stripped, at most ``limit`` characters."""
    if not isinstance(value, str):
        return ""
    text = value.replace("\x00", " ").encode("utf-8", "replace").decode("utf-8")
    return text.strip()[:limit].strip()


def _subject(alert: str | None, kind: str | None) -> str:
    what = (kind or "device").replace("_", " ")
    article = "an" if what[:1] in "aeiou" else "a"
    return f"{alert} on {article} {what}" if alert else f"this report about {article} {what}"


def _nothing(query: dict, outcome: str, reason: str, withheld: dict, signals: dict) -> Selection:
    return Selection(outcome="no_procedure", refs=[], reason=reason, primary=None,
                     withheld=withheld or {"documents": 0, "scopes": []}, signals=signals, query=query)


def _one_locale_each(docs: dict[int, _Doc], preferred: str) -> dict[int, _Doc]:
    """Keep one document per ``doc_id``: the one in ``preferred`` locale when there is one (its
    translation's code hits carry over)."""
    by_id: dict[str, list[_Doc]] = {}
    out = {}
    for d in docs.values():
        if d.doc_id:
            by_id.setdefault(d.doc_id, []).append(d)
        else:
            out[d.document_id] = d
    for group in by_id.values():
        keep = next((d for d in group if d.locale == preferred), None) or max(group, key=lambda d: d.similarity)
        keep.alert_hit = any(d.alert_hit for d in group)
        keep.report_code = next((d.report_code for d in group if d.report_code), None)
        out[keep.document_id] = keep
    return out


#: the cited chunks' fields and their documents' (no vectors, no whole document text), as tuples
_CITED_SQL = """
SELECT c.id, c.ordinal, c.section, c.start_offset, c.end_offset, c.scope, c.content_digest, c.text, c.locale,
       v.version, v.metadata, d.id, d.title, d.source, d.doc_id, d.requires_human_gate, d.owner
FROM evidence_chunk c
JOIN evidence_documentversion v ON v.id = c.document_version_id
JOIN evidence_document d ON d.id = v.document_id
WHERE c.id = ANY(%s)
"""


@dataclass(frozen=True)
class _Cited:
    """A candidate chunk for citation with what its reference needs (one row of :data:`_CITED_SQL`)."""

    pk: int
    ordinal: int
    section: str
    start_offset: int
    end_offset: int
    scope: str
    content_digest: str
    text: str
    locale: str
    version: int
    version_metadata: dict
    document_id: int
    title: str
    source: str
    doc_id: str
    requires_human_gate: bool
    owner: str


def _cited_chunks(ids: list[int]) -> dict[int, _Cited]:
    """The chunks ``ids`` with their versions' and documents' fields, by id (one statement; the
    ids come from the reader's permitted candidates)."""
    with connection.cursor() as cur:
        cur.execute(_CITED_SQL, [ids])
        fetched = cur.fetchall()
    out = {}
    for row in fetched:
        meta = row[10]
        meta = json.loads(meta) if isinstance(meta, str | bytes) else (meta or {})
        out[row[0]] = _Cited(*row[:10], meta or {}, *row[11:])
    return out


def _citations(primary: _Doc, ranked: list[_Doc], *, threshold: float, k: int, now: datetime, vague: bool,
               alert: str | None, decisive: bool) -> list[EvidenceRef]:
    """The cited chunks: the primary document's code line, its best-matching steps, its safety
    and escalation sections (up to :data:`PER_PRIMARY` when the report plainly names its subject or
    no other document fits it, else :data:`PER_DOCUMENT`), then the best chunk of each other
    document that also passes ``threshold`` within :data:`SECONDARY_MARGIN`, up to ``k``."""
    wanted = [*primary.chunks, *(max(d.chunks, key=d.chunks.get) for d in ranked if d is not primary and d.chunks)]
    chunks = _cited_chunks(wanted)
    own = sorted(primary.chunks, key=lambda cid: (chunks[cid].ordinal, cid))
    by_role: dict[str, list[int]] = {}
    for cid in own:
        by_role.setdefault(section_role(chunks[cid].section), []).append(cid)
    picked: list[int] = []
    if alert:
        coded = [cid for cid in own if alert in chunks[cid].text.upper()]
        code_chunk = next((cid for cid in coded if cid in by_role.get("codes", [])), coded[0] if coded else None)
        if code_chunk is not None:
            picked.append(code_chunk)
    steps = by_role.get("steps", [])
    if steps:
        if vague and alert:
            mentioning = [cid for cid in steps if alert in chunks[cid].text.upper()]
            best_step = mentioning[0] if mentioning else steps[0]
        else:
            # The procedure's order unless another section fits the report clearly better: a
            # technician diagnoses before replacing parts.
            best_step = max(steps, key=lambda cid: (primary.chunks[cid], -chunks[cid].ordinal))
            if primary.chunks[best_step] < primary.chunks[steps[0]] + STEP_MARGIN:
                best_step = steps[0]
        picked.append(best_step)
    elif not picked:
        picked.append(max(own, key=lambda cid: primary.chunks[cid]))
    # Other documents that also fit the report; when there are none, the report is about this one
    # document and its safety and escalation sections are cited beside its steps.
    others = [d for d in ranked if d is not primary and d.chunks and d.similarity >= threshold
              and not (d.alert_hit and primary.alert_hit)
              and (d.similarity >= primary.similarity - SECONDARY_MARGIN or d.report_code)]
    limit = PER_PRIMARY if decisive or not others else PER_DOCUMENT
    for role in ("safety", "escalation"):
        if by_role.get(role) and len(picked) < limit:
            picked.append(by_role[role][0])
    picked = list(dict.fromkeys(picked))[:limit]
    for d in others:
        if len(picked) < k:
            picked.append(max(d.chunks, key=d.chunks.get))
    return [_ref(chunks[cid], cos=_cos_of(cid, ranked), now=now) for cid in picked[:k]]


def _cos_of(cid: int, ranked: list[_Doc]) -> float:
    return next((d.chunks[cid] for d in ranked if cid in d.chunks), 0.0)


def _ref(c: _Cited, *, cos: float, now: datetime) -> EvidenceRef:
    standing = evidence_standing(c.version_metadata, now=now)
    return EvidenceRef(
        chunk_id=c.pk, document_id=c.document_id, document_title=c.title, source=c.source,
        version=c.version, section=c.section, start=c.start_offset, end=c.end_offset,
        scope=c.scope, content_digest=c.content_digest, score=round(cos, 6), vector_rank=None, text_rank=None,
        excerpt=c.text, locale=c.locale, doc_id=c.doc_id, stale=standing.stale,
        stale_reason=standing.reason if standing.stale else "", requires_human_gate=c.requires_human_gate,
        owner=c.owner,
    )
