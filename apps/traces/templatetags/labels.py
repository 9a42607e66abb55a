"""``{% load labels %}``: status codes as the reader's language names them.

``{{ code|status_label }}`` for a code read from a task's state or a row (``task.status``,
``state.approval.status``, an action's or outbox row's status): the label of the first vocabulary
that knows the code — task statuses, approval statuses, action statuses, outbox statuses, attempt
outcomes — or the code itself when none does (a code from a newer build is shown, never dropped).
The code stays in CSS classes and in machine-readable places; only what a person reads changes."""

from __future__ import annotations

from django import template

from apps.actions.models import ActionStatus, AttemptOutcome
from apps.approvals.models import ApprovalStatus
from apps.outbox.models import OutboxStatus
from apps.tasks.models import STATUS_LABELS, Urgency

register = template.Library()

#: the vocabularies, searched in this order (a code in two of them reads as the first's label)
VOCABULARIES = (STATUS_LABELS, dict(ApprovalStatus.choices), dict(ActionStatus.choices), dict(OutboxStatus.choices),
                dict(AttemptOutcome.choices), dict(Urgency.choices))


@register.filter
def status_label(code: object) -> object:
    """The translated label of ``code`` (see the module), or ``code`` unchanged."""
    if isinstance(code, str):
        for vocabulary in VOCABULARIES:
            if code in vocabulary:
                return vocabulary[code]
    return code
