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
from apps.outbox.models import OutboxStatus
from apps.tasks.answer import reason_zh
from apps.tasks.models import STATUS_LABELS, Urgency, reason_in_words
from apps.tickets.connectors import CONNECTORS

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
        return recorded
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
        text += " " + _("A person must approve: %(reason)s") % {"reason": forced}
    return text


@register.filter
def reason_label(reason: object) -> object:
    """A termination reason for the reader: its leading code (``ticket_created``,
    ``dispatch_failed: …``) named in their language, the recorded rest kept as written."""
    if not isinstance(reason, str):
        return reason
    return reason_in_words(reason)


#: reasons the agent records in English as fixed sentences, as a reader calls them
RECORDED_REASONS = {
    "another report's ticket for this device is being created: this report joins it":
        gettext_lazy("another report's ticket for this device is being created: this report joins it"),
    "the ticket changed since the approval": gettext_lazy("the ticket changed since the approval"),
    "the ticket changed since the approval (412)": gettext_lazy("the ticket changed since the approval (412)"),
}


@register.filter
def recorded_reason(reason: object) -> object:
    """A reason recorded as one of the agent's fixed sentences (:data:`RECORDED_REASONS`) in the
    reader's language; any other reason (a person's words, a variable text) as recorded."""
    return RECORDED_REASONS.get(reason, reason) if isinstance(reason, str) else reason


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
