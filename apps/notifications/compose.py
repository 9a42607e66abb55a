"""The words of a notification, composed in the reader's language when it is sent or shown (a
notification's ``context`` is data, never text: each recipient reads it in their saved language).

:func:`page_line` is what the bell and the notifications page show; :func:`email_parts` the
subject, plain text and HTML of the e-mail. Both read the language active when they are called:
the sender activates the recipient's saved language with ``translation.override``, a page the
reader's. Text recorded by the agent (its questions, a termination reason's details) is quoted as
recorded, its leading reason code named in the reader's language.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlencode

from django.conf import settings
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import translation
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from apps.notifications.models import Notification, NotificationKind
from apps.tasks.models import REASON_LABELS, STATUS_LABELS

#: the subject's tag, the same in every language (mail filters match it)
SUBJECT_TAG = "[faultdesk]"

def reason_for_reader(reason: str) -> str:
    """A recorded termination reason for the reader: its leading code (``cancelled``,
    ``dispatch_failed``…) in their words; the rest — recorded in English by the agent, or a person's
    words — kept as recorded, and marked so for a reader of another language when it is not in theirs
    (never passed off as a translation)."""
    if not reason:
        return ""
    english = (translation.get_language() or "en").startswith("en")
    m = re.match(r"([a-z_]+)(.*)\Z", reason, re.S)
    label = REASON_LABELS.get(m.group(1)) if m else None
    if label is None:
        return reason if english or _has_cjk(reason) else _("as recorded: %(recorded)s") % {"recorded": reason}
    rest = m.group(2).lstrip(":").strip()
    if not rest:
        return str(label)
    if english or _has_cjk(rest):
        return f"{label}: {rest}"
    return _("%(words)s (as recorded: %(recorded)s)") % {"words": label, "recorded": rest}


def _has_cjk(text: str) -> bool:
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def task_path(task_id) -> str:
    """The request's page (relative); the notifications page for a notification of no task."""
    return reverse("task-detail", args=[task_id]) if task_id else reverse("notification-list")


def approvals_path(asset_tag: str = "") -> str:
    """The approval queue (relative), filtered to ``asset_tag``'s device when given."""
    path = reverse("approval-queue")
    return f"{path}?{urlencode({'device': asset_tag})}" if asset_tag else path


def absolute(path: str) -> str:
    """``path`` on ``FAULTDESK["PUBLIC_BASE_URL"]`` (links in e-mails)."""
    return settings.FAULTDESK["PUBLIC_BASE_URL"].rstrip("/") + path


def _approval_line(ctx: dict) -> str:
    """What one approval item asks, in a line."""
    tag = ctx.get("asset_tag") or ""
    if ctx.get("compensation"):
        return _("%(asset_tag)s: close ticket %(ticket)s after its request was cancelled") % {
            "asset_tag": tag, "ticket": ctx.get("ticket") or "?"}
    if ctx.get("tool") == "ticket.comment":
        return _("%(asset_tag)s: add a comment to ticket %(ticket)s") % {"asset_tag": tag,
                                                                         "ticket": ctx.get("ticket") or "?"}
    if ctx.get("tool") == "ticket.create":
        return _("%(asset_tag)s: create a ticket") % {"asset_tag": tag}
    return _("%(asset_tag)s: %(tool)s") % {"asset_tag": tag, "tool": ctx.get("tool") or ""}


def _ended_title(ctx: dict) -> str:
    tag = ctx.get("asset_tag") or ""
    status = ctx.get("status")
    if ctx.get("after_cancel"):
        return _("Your cancelled request about %(asset_tag)s: what became of ticket %(ticket)s") % {
            "asset_tag": tag, "ticket": ctx.get("ticket") or "—"}
    if status == "COMPLETED" and str(ctx.get("reason") or "").startswith("proposal_rejected"):
        return _("Your request about %(asset_tag)s ended without a ticket: the proposal was rejected") % {
            "asset_tag": tag}
    if status == "COMPLETED" and not ctx.get("ticket"):
        return _("Your request about %(asset_tag)s ended without a ticket") % {"asset_tag": tag}
    if status == "COMPLETED":
        return _("Your request about %(asset_tag)s is completed") % {"asset_tag": tag}
    if status == "CANCELLED":
        return _("Your request about %(asset_tag)s was cancelled") % {"asset_tag": tag}
    return _("Your request about %(asset_tag)s failed") % {"asset_tag": tag}


def page_line(n: Notification) -> tuple[str, str]:
    """``(text, link path)`` of notification ``n`` for the bell and the notifications page, in the
    active language."""
    ctx = n.context or {}
    tag = ctx.get("asset_tag") or ""
    if n.kind == NotificationKind.INPUT_REQUESTED:
        return _("The agent asks a question about your report on %(asset_tag)s") % {"asset_tag": tag}, \
            task_path(n.task_id)
    if n.kind == NotificationKind.TICKET_CREATED:
        return _("Ticket %(ticket)s was created for your report on %(asset_tag)s") % {
            "ticket": ctx.get("ticket"), "asset_tag": tag}, task_path(n.task_id)
    if n.kind == NotificationKind.REPORT_JOINED:
        return _("Your report on %(asset_tag)s was added to ticket %(ticket)s") % {
            "ticket": ctx.get("ticket"), "asset_tag": tag}, task_path(n.task_id)
    if n.kind == NotificationKind.TASK_ENDED:
        return _ended_title(ctx), task_path(n.task_id)
    if n.kind == NotificationKind.APPROVAL_WAITING:
        return _("Waiting for your decision: %(what)s") % {"what": _approval_line(ctx)}, approvals_path(tag)
    count = len(ctx.get("items") or [])
    return ngettext("%(count)d approval waits for you", "%(count)d approvals wait for you", count) % {
        "count": count}, approvals_path()


@dataclass
class EmailParts:
    """An e-mail's words: ``subject``, the paragraphs, a bulleted list (``[(text, absolute URL or
    "")]``), the call to action's link, and both bodies rendered from them."""

    subject: str
    paragraphs: list[str]
    items: list[tuple[str, str]] = field(default_factory=list)
    link: str = ""
    link_text: str = ""
    text: str = ""
    html: str = ""


def email_parts(n: Notification) -> EmailParts:
    """The subject, plain-text and HTML bodies of notification ``n``'s e-mail in the active
    language. Raises ``ValueError`` for a kind that has no e-mail of its own (an approval item:
    it goes out in a digest)."""
    ctx = n.context or {}
    tag = ctx.get("asset_tag") or ""
    link_task, see_request = absolute(task_path(n.task_id)), _("Open the request")
    if n.kind == NotificationKind.INPUT_REQUESTED:
        parts = EmailParts(
            subject=_("Question about your report on %(asset_tag)s") % {"asset_tag": tag},
            paragraphs=[_("Before it can go on with your report on %(asset_tag)s, the agent needs your answer "
                          "to these questions:") % {"asset_tag": tag}],
            items=[(q, "") for q in ctx.get("questions") or []],
            link=link_task, link_text=_("Answer on the request's page"))
    elif n.kind == NotificationKind.TICKET_CREATED:
        parts = EmailParts(
            subject=_("Ticket %(ticket)s created for %(asset_tag)s") % {"ticket": ctx.get("ticket"), "asset_tag": tag},
            paragraphs=[_("Ticket %(ticket)s was created for your report on %(asset_tag)s; the ticket system "
                          "confirmed it.") % {"ticket": ctx.get("ticket"), "asset_tag": tag}],
            link=link_task, link_text=see_request)
    elif n.kind == NotificationKind.REPORT_JOINED:
        parts = EmailParts(
            subject=_("Your report on %(asset_tag)s was added to ticket %(ticket)s") % {
                "ticket": ctx.get("ticket"), "asset_tag": tag},
            paragraphs=[_("Ticket %(ticket)s was already open for %(asset_tag)s: your report was added to it as "
                          "comment %(comment)s, and no second ticket was made.") % {
                "ticket": ctx.get("ticket"), "asset_tag": tag, "comment": ctx.get("comment")}],
            link=link_task, link_text=see_request)
    elif n.kind == NotificationKind.TASK_ENDED:
        lines = [_("Status: %(status)s") % {"status": STATUS_LABELS.get(ctx.get("status"), ctx.get("status"))}]
        if ctx.get("reason"):
            lines.append(_("Reason: %(reason)s") % {"reason": reason_for_reader(ctx["reason"])})
        if ctx.get("approver_reason"):
            lines.append(_("The approver's reason: %(reason)s") % {"reason": ctx["approver_reason"]})
        if ctx.get("ticket"):
            lines.append(_("Ticket: %(ticket)s") % {"ticket": ctx["ticket"]})
        parts = EmailParts(subject=_ended_title(ctx), paragraphs=lines, link=link_task, link_text=see_request)
    elif n.kind == NotificationKind.APPROVAL_DIGEST:
        items = ctx.get("items") or []
        count = len(items)
        parts = EmailParts(
            subject=ngettext("%(count)d approval waits for you", "%(count)d approvals wait for you", count) % {
                "count": count},
            paragraphs=[ngettext("This request waits for your decision:", "These requests wait for your decision:",
                                 count)],
            items=[(_approval_line(i), absolute(approvals_path(i.get("asset_tag") or ""))) for i in items],
            link=absolute(approvals_path()), link_text=_("Open the approval queue"))
    else:
        raise ValueError(f"a {n.kind} notification has no e-mail of its own")
    parts.subject = f"{SUBJECT_TAG} {parts.subject}"
    context = {"parts": parts, "footer": _("You get this e-mail because of your role in faultdesk.")}
    parts.text = render_to_string("notifications/email.txt", context)
    parts.html = render_to_string("notifications/email.html", context)
    return parts
