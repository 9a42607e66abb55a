"""Task events → notifications, in the event's own transaction (a projection registered with
:func:`apps.tasks.store.projection_register` by :class:`~apps.notifications.apps.NotificationsConfig`).

What is noticed, comparing the task's state before the event with the state after it (DESIGN.md §1
"requester" and "approver"):

=============================  =================================================  ==============
the event …                    notification                                       to
=============================  =================================================  ==============
enters ``WAITING_INPUT``       ``input_requested`` (the agent's questions)        the requester
records the task's receipt     ``ticket_created`` (the ticket id), or             the requester
                               ``report_joined`` (a comment on another report's
                               ticket: which ticket the report joined)
ends the task                  ``task_ended`` (status, reason, ticket; the        the requester
                               approver's reason after a rejection)
ends a compensation            ``task_ended`` with ``after_cancel`` (the ticket   the requester
                               made before the cancel: closed, or left open)
asks for an approval           ``approval_waiting`` (held for the digest)         who may decide
(the proposal, or closing a
ticket after a cancel)
=============================  =================================================  ==============

A compensation that ends puts the task back into ``CANCELLED``: the requester, told of the cancel
already, learns what became of the ticket made before it. Most events match none of these and cost
no query; one that does costs a read of its recipients (and, for an approval, of the approval's
row) and one ``INSERT … ON CONFLICT DO NOTHING`` (the unique key ``(source_event_id, recipient,
kind)``: the projection run again for the same event adds nothing).
Recipients are members of the task's tenant only, active, with an active account; an approval's
are those holding a role the approval names, never the requester (nobody decides their own
request). Someone without an e-mail address gets the page notification only.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.utils import timezone

from apps.accounts.models import Membership
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.core.queue import NOTIFY_SEND, kick_on_commit
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.tasks import reducer

#: who decides an approval that names no roles (as the approvals app reads it)
DEFAULT_APPROVER_ROLES = ("approver", "admin")
#: statuses a compensation passes through after the task was cancelled: leaving them is no new end
_AFTER_CANCEL = frozenset({reducer.COMPENSATING, reducer.WAITING_COMPENSATION})


def notifications_from_event(task, event, new_state: dict) -> None:
    """Write the notifications ``event`` causes (see the module's table), inside its transaction,
    and kick the sender after the commit. ``task`` is the task as read before ``event``,
    ``new_state`` the state after it. Raises what the database raises (the event then rolls back
    with them)."""
    closed = approvals_closed(task.state or {}, new_state)
    if closed:
        # decided, invalidated or cancelled: the bell no longer calls anyone to it
        Notification.objects.for_tenant(task.tenant_id).filter(
            task_id=task.pk, kind=NotificationKind.APPROVAL_WAITING, read_at__isnull=True,
            context__approval_id__in=closed).update(read_at=timezone.now())
    wanted = changes_noticed(task.status, task.state or {}, new_state)
    if not wanted:
        return  # most events: no query
    rows = []
    asset_tag = ((new_state.get("request") or {}).get("asset_tag")) or ""
    requester_kinds = [(kind, ctx) for kind, ctx in wanted if kind != NotificationKind.APPROVAL_WAITING]
    if requester_kinds:
        address = _member_address(task.tenant_id, task.requester_id)
        if address is not None:
            rows += [_row(task, event, task.requester_id, address, kind, {**ctx, "asset_tag": asset_tag})
                     for kind, ctx in requester_kinds]
    for kind, ctx in wanted:
        if kind == NotificationKind.APPROVAL_WAITING:
            rows += _approval_rows(task, event, {**ctx, "asset_tag": asset_tag})
    if not rows:
        return
    Notification.objects.bulk_create(rows, ignore_conflicts=True)
    if any(r.status in (DeliveryStatus.PENDING, DeliveryStatus.HELD) for r in rows):
        kick_on_commit(NOTIFY_SEND)


def approvals_closed(before: dict, after: dict) -> list[str]:
    """Ids of the task's approvals (its proposal's, its compensation's) that were pending before the
    event and are not after it, or whose task the event ends (pure; no I/O)."""
    out = []
    ended = after.get("status") in reducer.TERMINAL  # a cancel or an end closes whatever was pending
    for old, new in ((before.get("approval"), after.get("approval")),
                     ((before.get("compensation") or {}).get("approval"),
                      (after.get("compensation") or {}).get("approval"))):
        if old and old.get("status") == "PENDING" and (ended or not (new and new.get("id") == old.get("id")
                                                                       and new.get("status") == "PENDING")):
            out.append(str(old.get("id")))
    return out


def changes_noticed(old_status: str, before: dict, after: dict) -> list[tuple[str, dict]]:
    """``[(kind, context)]`` a task event causes, from the status and state before it and the state
    after it (pure; no I/O). The contexts lack the recipient and the device's asset tag."""
    new_status = after.get("status")
    out: list[tuple[str, dict]] = []
    if new_status == reducer.WAITING_INPUT and old_status != reducer.WAITING_INPUT:
        out.append((NotificationKind.INPUT_REQUESTED, {"questions": list(after.get("questions") or [])}))
    receipt = after.get("receipt")
    if receipt and not before.get("receipt"):
        if receipt.get("kind") == "comment":
            out.append((NotificationKind.REPORT_JOINED, {"ticket": receipt.get("ticket_id") or "",
                                                         "comment": receipt.get("external_id") or ""}))
        elif receipt.get("kind", "ticket") == "ticket":
            out.append((NotificationKind.TICKET_CREATED, {"ticket": receipt.get("external_id") or ""}))
    if new_status in reducer.TERMINAL and old_status not in reducer.TERMINAL:
        ended = {"status": new_status, "reason": after.get("termination_reason") or "", "ticket": _ticket_of(receipt)}
        if old_status in _AFTER_CANCEL:
            # the cancelled request's ticket was closed, or left open: the requester learns which
            ended["after_cancel"] = True
            ended["ticket"] = ((after.get("compensation") or {}).get("ticket") or {}).get("external_id") \
                or ended["ticket"]
        approval = after.get("approval") or {}
        if approval.get("status") == "REJECTED" and approval.get("reason"):
            ended["approver_reason"] = str(approval["reason"])[:500]
        out.append((NotificationKind.TASK_ENDED, ended))
    approval = after.get("approval") or {}
    if new_status == reducer.WAITING_APPROVAL and approval.get("status") == "PENDING" \
            and _newly_pending(before.get("approval"), approval):
        out.append((NotificationKind.APPROVAL_WAITING, {"approval_id": approval["id"], "compensation": False,
                                                        "ticket": None}))
    comp = after.get("compensation") or {}
    comp_approval = comp.get("approval") or {}
    if comp.get("status") == "WAITING_APPROVAL" and comp_approval.get("status") == "PENDING" \
            and _newly_pending((before.get("compensation") or {}).get("approval"), comp_approval):
        out.append((NotificationKind.APPROVAL_WAITING, {
            "approval_id": comp_approval["id"], "compensation": True,
            "ticket": (comp.get("ticket") or {}).get("external_id")}))
    return out


def _newly_pending(old: dict | None, new: dict) -> bool:
    return not old or old.get("id") != new.get("id") or old.get("status") != "PENDING"


def _ticket_of(receipt: dict | None) -> str | None:
    """The ticket a receipt is about: the ticket commented on, or the ticket created."""
    if not receipt:
        return None
    return receipt.get("ticket_id") or receipt.get("external_id") or None


def _member_address(tenant_id: int, user_id: int) -> str | None:
    """The e-mail address of ``user_id`` while an active member of ``tenant_id`` with an active
    account (``""``: no address), else None. One query."""
    row = (Membership.objects.for_tenant(tenant_id)
           .filter(user_id=user_id, is_active=True, user__is_active=True)
           .values_list("user__email", flat=True).first())
    return None if row is None else (row or "")


def _approval_rows(task, event, ctx: dict) -> list[Notification]:
    """The ``approval_waiting`` items of the approval ``ctx["approval_id"]`` for each active member
    of the task's tenant who may decide it (its ``approver_roles``), the requester excepted. Two
    queries; none of them when the approval is gone or already decided (a carried-over approval)."""
    approval = (ApprovalRequest.objects.for_tenant(task.tenant_id).filter(pk=ctx["approval_id"])
                .values("status", "approver_roles", "requested_by_id", "tool", "params", "expires_at").first())
    if approval is None or approval["status"] != ApprovalStatus.PENDING:
        return []
    roles = approval["approver_roles"] or list(DEFAULT_APPROVER_ROLES)
    deciders = (Membership.objects.for_tenant(task.tenant_id)
                .filter(is_active=True, user__is_active=True, role__in=roles)
                .exclude(user_id=approval["requested_by_id"])
                .values_list("user_id", "user__email"))
    ticket = ctx.get("ticket") or (approval["params"] or {}).get("ticket_id")
    item = {**ctx, "tool": approval["tool"], "ticket": ticket, "expires_at": approval["expires_at"].isoformat()}
    return [_row(task, event, user_id, email or "", NotificationKind.APPROVAL_WAITING, item, held=True)
            for user_id, email in deciders]


def _row(task, event, user_id: int, address: str, kind: str, context: dict, *, held: bool = False) -> Notification:
    """One notification of ``kind`` for ``user_id`` about ``task``, caused by ``event`` (unsaved):
    page only when there is no ``address``; an approval item is held for the digest."""
    now = timezone.now()
    if not address:
        status = DeliveryStatus.SKIPPED
    else:
        status = DeliveryStatus.HELD if held else DeliveryStatus.PENDING
    n = Notification(tenant_id=task.tenant_id, recipient_id=user_id, kind=kind, task_id=task.pk,
                     source_event_id=event.id, source_event_seq=event.seq, context=context, status=status,
                     next_attempt_at=now if status == DeliveryStatus.PENDING else None,
                     last_error="" if address else "no e-mail address: page only")
    n.message_id = message_id_for(n.pk)
    return n


def message_id_for(notification_id) -> str:
    """The Message-ID of notification ``notification_id``'s e-mail: ``<notify.<id as 32 hex digits>@<domain>>``
    with ``FAULTDESK["NOTIFY_MESSAGE_ID_DOMAIN"]`` — the same at every resend, so a receiver that
    deduplicates by Message-ID keeps one copy (RFC 5322 §3.6.4). Short enough for the header to
    stay on one line with the default domain."""
    return f"<notify.{uuid.UUID(str(notification_id)).hex}@{settings.FAULTDESK['NOTIFY_MESSAGE_ID_DOMAIN']}>"
