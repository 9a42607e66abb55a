"""``{% load labels %}``: status codes as the reader's language names them, and the recorded
English sentences of a selection and an approval rebuilt in the reader's language.

``{{ code|status_label }}`` for a code read from a task's state or a row (``task.status``,
``state.approval.status``, an action's or outbox row's status): the label of the first vocabulary
that knows the code — task statuses, approval statuses, action statuses, outbox statuses, attempt
outcomes — or the code itself when none does (a code from a newer build is shown, never dropped).
The code stays in CSS classes and in machine-readable places; only what a person reads changes."""

from __future__ import annotations

import re

from django import template
from django.utils import translation
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from apps.actions.models import ActionStatus, AttemptOutcome
from apps.approvals.models import ApprovalStatus
from apps.evidence.guard import refs_flags
from apps.outbox.models import OutboxStatus
from apps.tasks.answer import NO_PROCEDURE_ZH, kind_label, reason_zh
from apps.tasks.models import STATUS_LABELS, Urgency, reason_in_words
from apps.tickets.connectors import CONNECTORS
from apps.traces.templatetags.plan_labels import recorded_sentence

register = template.Library()

#: the steps of a compensation (a task's ``state.compensation.status`` beyond the task statuses)
COMPENSATION_LABELS = {"REPLANNING": gettext_lazy("reading the ticket again"), "DONE": gettext_lazy("done"),
                       "RESOLVED": gettext_lazy("settled by an admin")}
#: the vocabularies, searched in this order (a code in two of them reads as the first's label)
VOCABULARIES = (STATUS_LABELS, dict(ApprovalStatus.choices), dict(ActionStatus.choices), dict(OutboxStatus.choices),
                dict(AttemptOutcome.choices), dict(Urgency.choices), COMPENSATION_LABELS)


@register.filter
def status_label(code: object) -> object:
    """The translated label of ``code`` (see the module), or ``code`` unchanged."""
    if isinstance(code, str):
        for vocabulary in VOCABULARIES:
            if code in vocabulary:
                return vocabulary[code]
    return code


def _english() -> bool:
    return (translation.get_language() or "en").split("-")[0] == "en"


def _why(text: str) -> str | None:
    """The selection's recorded ``why`` (apps/evidence/relevance.py) in the reader's language."""
    if text == "it matches the report best":
        return _("it matches the report best")
    if m := re.fullmatch(r"the device reports (.+), which it covers", text):
        return _("the device reports %(code)s, which it covers") % {"code": m.group(1)}
    if m := re.fullmatch(r"the report names (.+)", text):
        return _("the report names %(code)s") % {"code": m.group(1)}
    return None


@register.filter
def selection_reason(state: object) -> str:
    """Why the task's evidence was chosen — or why none was — for the reader: the recorded reason
    (English, as the selection wrote it) for an English reader; for another, the same sentence
    rebuilt from the recorded selection, or the recorded one when it cannot be."""
    state = state if isinstance(state, dict) else {}
    selection = state.get("selection") or {}
    recorded = selection.get("reason") or ""
    if _english() or not recorded:
        return recorded
    if selection.get("outcome") == "no_procedure":
        zh = reason_zh(selection, state.get("device") or {}) if translation.get_language().startswith("zh") else None
        return zh or recorded
    primary, evidence = selection.get("primary") or {}, state.get("evidence") or []
    why = _why(primary.get("why") or "")
    if why is None or not primary.get("title") or not evidence:
        return recorded
    return _("%(title)s v%(version)s bears on this report: %(why)s.") % {
        "title": primary["title"], "version": evidence[0].get("version"), "why": why}


_FORCED = " A person must approve: "
#: ticket systems' names (``connector.label``) as a reader calls them
SYSTEM_NAMES = {"the reference ticket service": gettext_lazy("the reference ticket service")}


@register.filter
def effects(approval: object) -> str:
    """What approving ``approval`` does, for the reader: its recorded sentence for an English
    reader (the one bound into the approval), otherwise the same sentence rebuilt from the
    approval's fields in the reader's language (the recorded one when it cannot be)."""
    recorded = getattr(approval, "side_effects", "") or ""
    if _english():
        return _one_stop(recorded)
    system = next((c.label for c in CONNECTORS.values() if f"in {c.label}" in recorded), None)
    if system is None:
        return recorded
    base, _sep, forced = recorded.partition(_FORCED)
    system = str(SYSTEM_NAMES.get(system, system))
    params = getattr(approval, "params", None) or {}
    values = {"system": system, "ticket": approval.object_id, "version": approval.object_version}
    if base.startswith("Compensation: closes ticket"):
        text = _("Compensation: closes ticket %(ticket)s in %(system)s, which was created although the request was "
                 "cancelled; only while the ticket is still at version %(version)s (If-Match). Rejecting leaves the "
                 "ticket open.") % values
    elif approval.tool == "ticket.comment":
        text = _("Adds one comment to ticket %(ticket)s in %(system)s, only while the ticket is still at version "
                 "%(version)s (If-Match); no new ticket.") % values
    elif approval.tool == "ticket.create":
        text = _("Creates one ticket in %(system)s for %(device)s with priority %(priority)s.") % {
            "system": system, "device": params.get("device") or approval.object_id,
            "priority": params.get("priority", "")}
    else:
        return recorded
    if forced:
        text += " " + _("A person must approve: %(reason)s") % {"reason": _forced_by(forced)}
    return text


def _one_stop(text: str) -> str:
    """``text`` with a doubled full stop at its end made one (a recorded reason that ended with its
    own stop, followed by the sentence's)."""
    return text[:-1] if text.endswith("..") and not text.endswith("...") else text


#: why a person must approve whatever the policy says (apps/approvals/policy.py ``forced_by``,
#: apps/agent/authorization.py), as a reader calls it
FORCED_FIXED = {"the evidence behind the earlier approval changed, and with it the action":
                gettext_lazy("the evidence behind the earlier approval changed, and with it the action.")}


def _forced_by(recorded: str) -> str:
    """The recorded ``forced_by`` (with the sentence's full stop) in the reader's language, or as
    recorded when it is of no known shape."""
    text = recorded[:-1] if recorded.endswith(".") else recorded
    if text in FORCED_FIXED:
        return str(FORCED_FIXED[text])
    if m := re.fullmatch(r"the cited procedure (.+) v(\S+) requires a person's approval", text, re.S):
        return _("the cited procedure %(title)s v%(version)s requires a person's approval.") % {
            "title": m.group(1), "version": m.group(2)}
    if m := re.fullmatch(r"proposed without a procedure: (.+)", text, re.S):
        return _("proposed without a procedure: %(reason)s") % {"reason": no_procedure_reason(m.group(1))}
    return _one_stop(recorded)


def _kind(words: str) -> str:
    """A device kind as the selection wrote it in English (``wireless ap``) in the reader's words."""
    return kind_label(words.replace(" ", "_"), "zh") if _chinese() else words


def _chinese() -> bool:
    return (translation.get_language() or "").startswith("zh")


def _subject_zh(subject: str) -> str | None:
    if m := re.fullmatch(r"(\S+) on an? (.+)", subject):
        return f"{_kind(m.group(2))}上的 {m.group(1)}"
    if m := re.fullmatch(r"this report about an? (.+)", subject):
        return f"这份关于{_kind(m.group(1))}的报告"
    return None


def no_procedure_reason(recorded: str) -> str:
    """Why no procedure was cited, as the selection recorded it (apps/evidence/relevance.py), in
    the reader's language — rebuilt from the sentence alone (what an approval keeps of it) — or as
    recorded (a doubled final stop made one) when it is of no known shape or the reader's language
    has no rendering of it."""
    text = _one_stop(recorded)
    if not _chinese():
        return text
    sentence = text[:-1] if text.endswith(".") else text
    if sentence == "You may read no procedures in this tenant":
        return NO_PROCEDURE_ZH["no_scopes"]
    if sentence == ("The report does not say what is wrong and the device reports no alert code, so no procedure "
                    "can be chosen; a person will ask"):
        return NO_PROCEDURE_ZH["no_content"]
    if m := re.fullmatch(r"No procedure in the knowledge base covers this report: it reads as being about something "
                         r"other than the (.+)'s faults, which the maintenance procedures do not cover", sentence):
        return NO_PROCEDURE_ZH["out_of_scope"].format(kind=_kind(m.group(1)))
    if m := re.fullmatch(r"No procedure you may read covers (.+); a procedure in a scope you cannot read \((.+)\) "
                         r"covers it, and the .+ team holds it", sentence):
        if (subject := _subject_zh(m.group(1))) is not None:
            return NO_PROCEDURE_ZH["withheld"].format(subject=subject, scopes="、".join(m.group(2).split(", ")))
    if (m := re.fullmatch(r"No procedure in the knowledge base covers (.+) as reported", sentence)) and \
            (subject := _subject_zh(m.group(1))) is not None:
        return NO_PROCEDURE_ZH["uncovered"].format(subject=subject)
    return text


@register.filter
def reason_label(reason: object) -> object:
    """A termination reason for the reader: its leading code (``ticket_created``,
    ``dispatch_failed: …``) named in their language, the recorded rest kept as written."""
    if not isinstance(reason, str):
        return reason
    return reason_in_words(reason)


@register.filter
def recorded_reason(reason: object) -> object:
    """A reason recorded as one of the agent's sentences — a fixed one (``plan_labels.RECORDED_REASONS``)
    or one of a known shape (why an approval was invalidated or closed, with what moved: premises,
    chunks, versions) — in the reader's language; any other reason (a person's words) as recorded."""
    return recorded_sentence(reason)


@register.filter
def cited_documents(evidence: object) -> str:
    """The documents an approval's own ``evidence`` cites (``title vN``, in Chinese ``《title》vN``,
    each once, in citation order) as a reader lists them."""
    seen: list[str] = []
    chinese = _chinese()
    for ref in evidence if isinstance(evidence, list) else []:
        if isinstance(ref, dict):
            title = ref.get('document_title') or ref.get('source') or '?'
            name = f"《{title}》v{ref.get('version')}" if chinese else f"{title} v{ref.get('version')}"
            if name not in seen:
                seen.append(name)
    return ("、" if chinese else ", ").join(seen)


#: how a chunk an approval cites moved since it was asked (QueueRow.evidence_moved's statuses)
MOVED_LABELS = {"superseded": gettext_lazy("superseded since it was asked"),
                "retired": gettext_lazy("withdrawn since it was asked"),
                "unreadable": gettext_lazy("no longer readable by the requester")}


@register.filter
def moved_label(moved: object, chunk_id: object) -> str:
    """``{{ r.evidence_moved|moved_label:e.chunk_id }}``: the reader's words for how the cited chunk
    ``chunk_id`` moved since its approval was asked (``moved``: an
    :class:`~apps.approvals.selectors.EvidenceMoved` or None), or ``""`` when it did not."""
    chunks = getattr(moved, "chunks", None)
    status = chunks.get(str(chunk_id)) if isinstance(chunks, dict) else None
    return str(MOVED_LABELS.get(status, "")) if status else ""


@register.filter
def moved_documents(evidence: object, moved: object) -> str:
    """``{{ a.evidence|moved_documents:r.evidence_moved }}``: the documents (as
    :func:`cited_documents` lists them) of the cited chunks that moved since the approval was asked
    (``moved``: an :class:`~apps.approvals.selectors.EvidenceMoved` or None)."""
    chunks = getattr(moved, "chunks", None)
    moved = chunks if isinstance(chunks, dict) else {}
    refs = [r for r in evidence if isinstance(r, dict) and str(r.get("chunk_id")) in moved] \
        if isinstance(evidence, list) else []
    return cited_documents(refs)


@register.filter
def evidence_flags(evidence: object) -> list[dict]:
    """``[{"chunk_id", "source", "flags"}]`` for an approval's own evidence references whose
    excerpt reads like instructions (:func:`apps.evidence.guard.refs_flags`); none once purged."""
    refs = [r for r in evidence if isinstance(r, dict) and "chunk_id" in r] if isinstance(evidence, list) else []
    return refs_flags(refs)


@register.filter
def iso_datetime(value: object):
    """An ISO 8601 date and time (as recorded in parameters) as a datetime for the ``date``
    filter, in UTC; the value unchanged when it is not one."""
    from datetime import UTC, datetime

    if not isinstance(value, str):
        return value
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    return parsed.astimezone(UTC) if parsed.tzinfo else parsed
