"""Reconciliation by a person: the admin's view of actions whose outcome is unknown, and the two
recorded resolutions, "executed, here is the ticket" and "not executed" (DESIGN.md §6; spec
§16.4 "结果未知", table 16.5 row "remote done, response lost").

The reconciler (:func:`apps.outbox.unknown_outcomes.actions_reconcile`) settles most unknown outcomes by
itself: it looks the action up by key and adopts the ticket, or re-sends with the same key. An
action waits for a person when its tool has no result lookup, or when the lookups have failed
``FAULTDESK["RECONCILE_ESCALATE_AFTER"]`` times. An admin may resolve any unknown action, and a
person's word is checked against the ticket system before it is recorded:

* **executed**: the named ticket must exist and carry this action's idempotency key (a ticket
  without it, or with another action's, is refused without saying whose it is). The ticket is recorded as the receipt
  (``receipt.recorded`` with a ``resolution``: who, why, verified).
* **not executed**: the outbox row is claimed with a new fencing token, the key is fenced at the
  ticket system with it and looked up (see ADR 0009). A ticket found is recorded as the receipt
  instead and the person is told (409). Nothing found: the action is ``NOT_SENT`` and
  ``dispatch.failed`` (``executed: false``, with the resolution) ends the task's wait.

Both are events with the person as actor; neither is possible for another tenant's action.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils.translation import gettext as _

from apps.accounts.principal import Principal
from apps.actions.models import Action, ActionStatus
from apps.actions.registry import tool_get
from apps.core import tool_errors as errors
from apps.core.errors import Conflict, Forbidden, NotFound, Unavailable, Unprocessable
from apps.outbox.settlement import receipt_record
from apps.outbox.unknown_outcomes import ActionChanged, action_settle_unknown
from apps.tickets.connectors import connector_for, ticket_receipt
from config.logs import bound

MAX_NOTE = 1000


def _cannot_ask(exc: errors.ToolError) -> str:
    """The refusal when the ticket system cannot be asked (``exc``'s detail is the connector's own
    text: it stays in English)."""
    return _("the ticket system cannot be asked now (%(detail)s); nothing was recorded") % {"detail": exc.detail}


@dataclass(frozen=True)
class UnknownAction:
    """One row of the reconciliation page: the action (with its task, device and attempts
    prefetched), whether it waits for a person, and why."""

    action: Action
    needs_person: bool
    why: str


def _require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise Forbidden(_("only an admin may reconcile actions"))


def reconciliation_list(*, principal: Principal) -> list[UnknownAction]:
    """The principal's tenant's actions whose outcome is unknown, oldest first, each marked
    whether it waits for a person. Raises ``Forbidden`` for a non-admin."""
    _require_admin(principal)
    escalate = settings.FAULTDESK["RECONCILE_ESCALATE_AFTER"]
    rows = (Action.objects.visible_to(principal).filter(status=ActionStatus.UNKNOWN)
            .select_related("task", "task__device", "task__requester").prefetch_related("attempts")
            .order_by("created_at"))
    out = []
    for action in rows:
        if tool_get(action.tool).result_lookup is None:
            out.append(UnknownAction(action, True, _("this tool has no result lookup: only a person can tell")))
        elif action.reconcile_attempts >= escalate:
            out.append(UnknownAction(action, True, _("%(count)s lookups by key did not settle it")
                                      % {"count": action.reconcile_attempts}))
        else:
            out.append(UnknownAction(action, False, _("the reconciler is still looking it up by key")))
    return out


def reconciliation_resolve(*, principal: Principal, action_id, executed: bool, external_id: str = "",
                           note: str = "") -> Action:
    """Record a person's resolution of the unknown action ``action_id`` and return the action.

    ``executed=True`` needs ``external_id`` (the ticket that was created); ``note`` (why the
    person knows, 1..1000 characters) is always required.

    Raises ``NotFound`` (not an action of the principal's tenant), ``Forbidden`` (not an admin),
    ``Unprocessable`` (missing note or ticket id; the ticket does not exist or belongs to another
    action), ``Conflict`` (the action is no longer unknown, or the ticket system holds a ticket
    for "not executed" — which is then recorded as the receipt) and ``Unavailable`` (the ticket
    system cannot be asked; nothing is recorded).
    """
    _require_admin(principal)
    action = Action.objects.visible_to(principal).filter(pk=action_id).first()
    if action is None:
        raise NotFound(_("action not found"))
    note = (note or "").strip()
    if not note:
        raise Unprocessable(_("say how you know (note)"))
    if len(note) > MAX_NOTE:
        raise Unprocessable(_("the note is limited to %(max)s characters") % {"max": MAX_NOTE})
    if action.status != ActionStatus.UNKNOWN:
        raise Conflict(_("the action is %(status)s, not unknown: nothing to resolve") % {"status": action.status},
                       status=action.status)
    actor = principal.as_actor()
    if executed:
        with bound(tenant_id=action.tenant_id, task_id=action.task_id):  # the gateway records its calls with them
            return _resolve_executed(action, (external_id or "").strip(), note, actor)
    return _resolve_not_executed(action, note, actor)


def _resolve_executed(action: Action, external_id: str, note: str, actor: str) -> Action:
    if not external_id:
        raise Unprocessable(_("name the ticket that was created (external_id)"))
    if action.tool != "ticket.create":
        return _resolve_write_executed(action, external_id, note, actor)
    try:
        ticket = connector_for(action.tool, action.connector).get_ticket(external_id=external_id)
    except errors.ToolError as exc:
        raise Unavailable(_cannot_ask(exc)) from exc
    if ticket is None:
        raise Unprocessable(_("the ticket system has no ticket %(ticket)s") % {"ticket": external_id})
    if ticket.get("idempotency_key") != action.idempotency_key:
        # Only a ticket that carries this action's key is its effect. Say nothing about whose it is.
        raise Unprocessable(_("ticket %(ticket)s was not created by this action (it does not carry its key)")
                            % {"ticket": external_id})
    try:
        receipt = ticket_receipt(ticket, replayed=True, connector=action.connector)
    except errors.OutcomeUnknown as exc:
        raise Unavailable(_("the ticket system's answer for %(ticket)s is malformed (%(detail)s); nothing was recorded")
                          % {"ticket": external_id, "detail": exc.detail}) from exc
    with transaction.atomic():
        locked = Action.objects.select_for_update().get(pk=action.pk)
        if locked.status != ActionStatus.UNKNOWN:
            raise Conflict(_("the action became %(status)s meanwhile") % {"status": locked.status},
                           status=locked.status)
        receipt_record(action_id=action.pk, receipt=receipt, actor=actor,
                       resolution={"by": actor, "executed": True, "note": note, "verified": "ticket read by id"})
    action.refresh_from_db()
    return action


def _resolve_write_executed(action: Action, external_id: str, note: str, actor: str) -> Action:
    """A comment or update on an existing ticket: it was executed only if that ticket holds a
    write made with the action's key (the tool's result lookup)."""
    if external_id not in (action.params.get("ticket_id"), action.external_id):
        raise Unprocessable(_("this action writes to ticket %(ticket)s, not %(named)s")
                            % {"ticket": action.params.get("ticket_id"), "named": external_id})
    try:
        found = connector_for(action.tool, action.connector).lookup(
            tool=action.tool, idempotency_key=action.idempotency_key, params=action.params)
    except errors.ToolError as exc:
        raise Unavailable(_cannot_ask(exc)) from exc
    if found is None:
        raise Unprocessable(_("ticket %(ticket)s holds no %(tool)s made with this action's key")
                            % {"ticket": external_id, "tool": action.tool})
    with transaction.atomic():
        locked = Action.objects.select_for_update().get(pk=action.pk)
        if locked.status != ActionStatus.UNKNOWN:
            raise Conflict(_("the action became %(status)s meanwhile") % {"status": locked.status},
                           status=locked.status)
        receipt_record(action_id=action.pk, receipt=found, actor=actor,
                       resolution={"by": actor, "executed": True, "note": note, "verified": "found by key"})
    action.refresh_from_db()
    return action


def _resolve_not_executed(action: Action, note: str, actor: str) -> Action:
    resolution = {"by": actor, "executed": False, "note": note, "verified": "fenced, nothing found by key"}
    try:
        found = action_settle_unknown(action, actor=actor, reason="resolved_not_executed", resolution=resolution)
    except errors.ToolError as exc:
        raise Unavailable(_cannot_ask(exc)) from exc
    except ActionChanged as exc:
        raise Conflict(_("the action changed meanwhile (it is now %(status)s); look again") % {"status": exc.status}
                       ) from exc
    if found is not None:
        raise Conflict(_("the ticket system holds ticket %(ticket)s for this action's key: it was executed, and is "
                         "now recorded as the receipt") % {"ticket": found.external_id}, external_id=found.external_id)
    action.refresh_from_db()
    return action
