"""Governance metadata of knowledge documents and the rules retrieval applies to it (spec §16.2
table 16.2 "evidence reference"; the documentation projection in ``shared/seeds``).

A document carries the seed projection's fields: who owns it, whether it is approved and published,
from when to when it is in force, when it was last verified and is due for review, its safety class,
whether any action citing it needs a person's approval (``requires_human_gate``), and what it
applies to (``device_kinds``, ``device_models``, ``alert_codes``). Its text never grants authority:
``command_authority`` and ``operational_effect`` are recorded, never acted on.

Where the metadata comes from:

* Markdown and plain text: a YAML front matter block between ``---`` lines at the top of the file;
* HTML: ``<meta name="faultdesk:<field>" content="...">`` tags (lists comma-separated);
* PDF: document-information entries named after the fields (``/doc_id``, ``/governance_status``…);
* the seed's JSON projection (:mod:`apps.evidence.projection`): the fields of its chunks.

A document ingested without metadata is taken as approved and published by the admin who ingested
it (the ingest command is that admin's act), current, in no device's particular scope.

The rules (:func:`evidence_standing`): unapproved, unpublished, not yet effective or expired
documents are not evidence; a document past ``review_due_at`` or whose freshness is not ``CURRENT``
is evidence with a visible "stale" mark.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time

import yaml

GOVERNANCE_APPROVED = "APPROVED"
FRESHNESS_CURRENT = "CURRENT"
#: publication statuses that make a document readable as evidence (the seed uses PUBLISHED_GLOBAL)
PUBLISHED_PREFIX = "PUBLISHED"

#: fields stored as timestamps (a bare date means 00:00 UTC that day)
DATE_FIELDS = ("effective_at", "expires_at", "last_verified_at", "review_due_at")
LIST_FIELDS = ("device_kinds", "device_models", "alert_codes")
BOOL_FIELDS = ("requires_human_gate",)
TEXT_FIELDS = (
    "doc_id", "doc_version", "locale", "owner", "governance_status", "publication_status", "freshness_status",
    "safety_class", "operational_effect", "command_authority", "limitations", "canonical_url", "source_commit",
    "citation_id",
)
FIELDS = (*TEXT_FIELDS, *DATE_FIELDS, *LIST_FIELDS, *BOOL_FIELDS)

DEFAULTS = {
    "governance_status": GOVERNANCE_APPROVED,
    "publication_status": PUBLISHED_PREFIX,
    "freshness_status": FRESHNESS_CURRENT,
    "requires_human_gate": False,
    "operational_effect": "NONE",
    "command_authority": "NONE",
}


class MetadataInvalid(ValueError):
    """Front matter or metadata that cannot be read (a bad date, a list where text belongs...)."""


_FRONT_MATTER = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def front_matter_split(raw: str) -> tuple[dict, str]:
    """``(metadata, body)`` of a Markdown/text file: the YAML block between a first line ``---``
    and the next ``---`` line, and the text after it. A file without such a block is ``({}, raw)``.
    Raises :class:`MetadataInvalid` for a block that is not a YAML mapping."""
    m = _FRONT_MATTER.match(raw)
    if not m:
        return {}, raw
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError as exc:
        raise MetadataInvalid(f"front matter is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise MetadataInvalid("front matter must be a mapping of field: value")
    return data, raw[m.end():]


def html_metadata(raw: str) -> dict:
    """The ``<meta name="faultdesk:<field>" content="...">`` tags of an HTML document."""
    from html import unescape

    out: dict = {}
    for tag in re.findall(r"<meta\b[^>]*>", raw, flags=re.IGNORECASE):
        name = re.search(r"""\bname\s*=\s*["']faultdesk:([a-z_]+)["']""", tag, flags=re.IGNORECASE)
        content = re.search(r"""\bcontent\s*=\s*(["'])(.*?)\1""", tag, flags=re.IGNORECASE | re.DOTALL)
        if name and content:
            field, value = name.group(1).lower(), unescape(content.group(2))
            out[field] = [v.strip() for v in value.split(",") if v.strip()] if field in LIST_FIELDS else value
    return out


def _timestamp(field: str, value) -> str | None:
    if value in (None, "", "NOT_SET"):
        return None
    if isinstance(value, datetime):
        dt = value
    elif isinstance(value, date):
        dt = datetime.combine(value, time.min)
    elif isinstance(value, str):
        try:
            dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError as exc:
            raise MetadataInvalid(f"{field}: {value!r} is not an ISO date or timestamp") from exc
    else:
        raise MetadataInvalid(f"{field}: {value!r} is not a date")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).isoformat()


def metadata_normalise(raw: dict, *, text: str = "") -> dict:
    """The document metadata faultdesk stores: every field of :data:`FIELDS` (unknown keys are kept
    under ``"extra"``), dates as ISO-8601 UTC strings or None, lists as lists of stripped strings,
    statuses upper-case, defaults (:data:`DEFAULTS`) for the missing ones and ``locale`` detected
    from ``text`` when absent (``zh-CN`` when a fifth of its letters are Chinese, else ``en``).

    Raises :class:`MetadataInvalid` for a value of the wrong shape."""
    out: dict = {k: None for k in FIELDS}
    extra = {}
    for key, value in raw.items():
        key = str(key).strip().lower()
        if key not in FIELDS:
            extra[key] = json.loads(json.dumps(value, default=str))  # JSON-shaped (dates as text)
            continue
        if key in DATE_FIELDS:
            out[key] = _timestamp(key, value)
        elif key in LIST_FIELDS:
            if isinstance(value, str):
                value = [v for v in value.split(",")]
            if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
                raise MetadataInvalid(f"{key}: expected a list of names, got {value!r}")
            out[key] = [str(v).strip() for v in value if str(v).strip()]
        elif key in BOOL_FIELDS:
            if isinstance(value, str) and value.strip().lower() in ("true", "yes", "1", "false", "no", "0"):
                value = value.strip().lower() in ("true", "yes", "1")
            if not isinstance(value, bool):
                raise MetadataInvalid(f"{key}: expected true or false, got {value!r}")
            out[key] = value
        else:
            if isinstance(value, list | dict):
                raise MetadataInvalid(f"{key}: expected text, got {value!r}")
            out[key] = None if value is None else str(value).strip()
    for key in ("governance_status", "publication_status", "freshness_status", "safety_class",
                "operational_effect", "command_authority"):
        if out[key]:
            out[key] = out[key].upper()
    for key, value in DEFAULTS.items():
        if out[key] in (None, ""):
            out[key] = value
    for key in LIST_FIELDS:
        out[key] = out[key] or []
    out["device_kinds"] = [k.lower() for k in out["device_kinds"]]
    out["alert_codes"] = [c.upper() for c in out["alert_codes"]]
    if not out["locale"]:
        out["locale"] = locale_detect(text)
    out["extra"] = extra
    return out


def locale_detect(text: str) -> str:
    """``"zh-CN"`` when at least a fifth of the letters of ``text`` are CJK ideographs, else ``"en"``."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return "en"
    return "zh-CN" if len(_CJK.findall(text)) * 5 >= len(letters) else "en"


def is_chinese(text: str) -> bool:
    """Whether ``text`` is mostly Chinese (:func:`locale_detect`)."""
    return locale_detect(text) == "zh-CN"


@dataclass(frozen=True)
class Standing:
    """Where a document stands as evidence at one moment: ``evidence`` (may it be cited at all),
    ``stale`` (cite with a visible mark), and ``reason`` (why not evidence, or why stale; "")."""

    evidence: bool
    stale: bool
    reason: str


def _parse(ts) -> datetime | None:
    if ts is None or isinstance(ts, datetime):
        return ts
    return datetime.fromisoformat(ts)


def evidence_standing(meta: dict, *, now: datetime) -> Standing:
    """Apply the governance rules to a document's metadata (a :func:`metadata_normalise` dict or a
    :class:`~apps.evidence.models.Document`'s fields as a dict) at ``now`` (aware).

    Not evidence: governance status other than APPROVED, publication status not PUBLISHED*,
    ``effective_at`` after ``now``, ``expires_at`` at or before ``now``. Stale: freshness other
    than CURRENT, or ``review_due_at`` at or before ``now``."""
    if (meta.get("governance_status") or GOVERNANCE_APPROVED) != GOVERNANCE_APPROVED:
        return Standing(False, False, f"not approved (governance {meta['governance_status']})")
    if not (meta.get("publication_status") or PUBLISHED_PREFIX).startswith(PUBLISHED_PREFIX):
        return Standing(False, False, f"not published (publication {meta['publication_status']})")
    effective, expires = _parse(meta.get("effective_at")), _parse(meta.get("expires_at"))
    if effective is not None and effective > now:
        return Standing(False, False, f"not in force until {effective.date().isoformat()}")
    if expires is not None and expires <= now:
        return Standing(False, False, f"expired on {expires.date().isoformat()}")
    freshness = meta.get("freshness_status") or FRESHNESS_CURRENT
    review_due = _parse(meta.get("review_due_at"))
    if freshness != FRESHNESS_CURRENT:
        return Standing(True, True, f"freshness {freshness}")
    if review_due is not None and review_due <= now:
        return Standing(True, True, f"review was due on {review_due.date().isoformat()}")
    return Standing(True, False, "")
