"""Sending notification e-mails from their outbox rows: each notification is an outbox message,
sent once, after the commit that wrote it, and surviving a crash (DESIGN.md §6's dispatcher, for
people).

One row goes through three phases, each its own transaction, the SMTP conversation in a phase of
its own:

1. **claim** (:func:`claim_due`): ``SELECT … FOR UPDATE SKIP LOCKED`` the due rows — ``PENDING`` and
   due, or ``SENDING`` with an expired lease (a sender that died) — and lease them: owner, expiry,
   one more attempt, and a new fencing token (``lease_generation``);
2. **send**: compose the e-mail in the recipient's saved language and hand it to the e-mail backend
   (``EMAIL_BACKEND``; SMTP in production, through the tool gateway, which checks the relay's
   address, logs in with the credential it holds and records each send). A sender whose lease ran
   out before the send does not send (the next claim does);
3. **mark**, fenced by the token: ``SENT`` once the SMTP server accepted the message; back to
   ``PENDING`` with exponential backoff and jitter after a temporary failure (a 4xx reply, a refused
   or dropped connection); ``FAILED`` after a permanent refusal (5xx) or the last of
   ``FAULTDESK["NOTIFY_MAX_ATTEMPTS"]`` attempts, with the error recorded. A mark whose token is no
   longer the row's changes nothing (another sender took the row over).

Exactly once, and where it cannot be: a crash before the send leaves the row ``SENDING`` until its
lease expires, then it is claimed and sent once. A crash after the SMTP server accepted the message
and before the ``SENT`` mark committed (or a sender stalled past its lease) cannot be told apart
from one before the send, so the row is sent again — as the *same* message: every send of a row
carries the Message-ID derived from the row's id (``<notify.<id>@<domain>>``) and the header
``X-Faultdesk-Notification: <id>``, by which a receiving system or mail client deduplicates. That
window is the time between the server's "250 OK" and the commit of the mark: milliseconds, unless
the process dies in it.
"""

from __future__ import annotations

import logging
import random
import smtplib
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.db import connection, transaction
from django.utils import timezone, translation

from apps.accounts.language import supported
from apps.accounts.models import LanguagePreference, Membership
from apps.core.failpoints import failpoint
from apps.gateway.smtp import email_connection
from apps.notifications.compose import email_parts
from apps.notifications.models import DeliveryStatus, Notification

log = logging.getLogger(__name__)

_TABLE = Notification._meta.db_table

_CLAIM_SQL = f"""
WITH due AS (
    SELECT n.id FROM {_TABLE} n
    WHERE (n.status = 'PENDING' AND n.next_attempt_at <= %(now)s)
       OR (n.status = 'SENDING' AND n.lease_expires_at < %(now)s)
    ORDER BY n.next_attempt_at, n.id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
UPDATE {_TABLE} m SET status = 'SENDING', lease_owner = %(owner)s, lease_expires_at = %(until)s,
    lease_generation = m.lease_generation + 1, attempts = m.attempts + 1
FROM due WHERE m.id = due.id
RETURNING m.id
"""  # noqa: S608 - the table name is the model's own

_MARK_SQL = f"""
UPDATE {_TABLE} SET status = %(status)s, sent_at = %(sent_at)s, email_to = %(email_to)s,
    last_error = %(error)s, next_attempt_at = %(next_attempt_at)s, lease_owner = '', lease_expires_at = NULL
WHERE id = %(id)s AND lease_generation = %(generation)s AND status = 'SENDING'
"""  # noqa: S608 - the table name is the model's own


def claim_due(*, owner: str, limit: int, now=None) -> list[Notification]:
    """Claim up to ``limit`` due rows (see the module), skipping rows other senders hold locked.
    Each claimed row is ``SENDING`` under ``owner``'s lease of ``FAULTDESK["NOTIFY_LEASE_SECONDS"]``,
    with one more attempt and a new fencing token. Returns them oldest first, each with its
    recipient; one transaction of two statements."""
    now = now or timezone.now()
    until = now + timedelta(seconds=settings.FAULTDESK["NOTIFY_LEASE_SECONDS"])
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_CLAIM_SQL, {"now": now, "limit": limit, "owner": owner, "until": until})
        ids = [row[0] for row in cursor.fetchall()]
    if not ids:
        return []
    return list(Notification.objects.filter(pk__in=ids).select_related("recipient")
                .order_by("next_attempt_at", "pk"))


def backoff_seconds(attempt: int, *, rng: random.Random | None = None) -> float:
    """The wait before attempt ``attempt + 1`` after a temporary failure of attempt ``attempt``
    (1-based): ``base · 2^(attempt-1)`` capped at ``FAULTDESK["NOTIFY_RETRY_CAP_SECONDS"]``, with
    "equal jitter" (half fixed, half random), so retries neither hammer a recovering server nor
    come back all at once. ``base`` is ``FAULTDESK["NOTIFY_RETRY_BASE_SECONDS"]``."""
    rng = rng or random.Random()  # noqa: S311 - jitter, not security
    conf = settings.FAULTDESK
    delay = min(conf["NOTIFY_RETRY_CAP_SECONDS"], conf["NOTIFY_RETRY_BASE_SECONDS"] * 2 ** max(attempt - 1, 0))
    return delay / 2 + rng.uniform(0, delay / 2)


@dataclass(frozen=True)
class SendFailure:
    """Why a send failed: ``permanent`` (a 5xx refusal: never retried) or not, and the error."""

    permanent: bool
    error: str


def failure_of(exc: BaseException) -> SendFailure:
    """Classify an exception of the e-mail backend: an SMTP 5xx reply (for every recipient) is
    permanent; a 4xx reply, a refused, dropped or timed-out connection, anything else, temporary."""
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _msg in exc.recipients.values()]
        return SendFailure(bool(codes) and all(c >= 500 for c in codes), f"recipients refused: {exc.recipients!r}")
    if isinstance(exc, smtplib.SMTPResponseException):
        return SendFailure(exc.smtp_code >= 500, f"SMTP {exc.smtp_code}: {exc.smtp_error!r}")
    return SendFailure(False, f"{type(exc).__name__}: {exc}")


def _mark(n: Notification, status: str, *, now, error: str = "", email_to: str = "",
          next_attempt_at=None) -> bool:
    """The fenced mark of ``n`` (claimed with token ``n.lease_generation``); False when the token
    is no longer the row's (another sender holds it now) and nothing changed."""
    with connection.cursor() as cursor:
        cursor.execute(_MARK_SQL, {"status": status, "sent_at": now if status == DeliveryStatus.SENT else None,
                                   "email_to": email_to, "error": error[:2000], "next_attempt_at": next_attempt_at,
                                   "id": n.pk, "generation": n.lease_generation})
        done = cursor.rowcount == 1
    if not done:
        log.warning("notification %s: lease %s lost before marking it %s", n.pk, n.lease_generation, status)
    return done


def _mark_failed_attempt(n: Notification, failure: SendFailure, *, now) -> str:
    """Back to PENDING after backoff, or FAILED (permanent, or the last attempt). Returns the status."""
    if failure.permanent or n.attempts >= settings.FAULTDESK["NOTIFY_MAX_ATTEMPTS"]:
        _mark(n, DeliveryStatus.FAILED, now=now, error=failure.error)
        log.error("notification %s failed after %d attempts: %s", n.pk, n.attempts, failure.error)
        return DeliveryStatus.FAILED
    retry_at = now + timedelta(seconds=backoff_seconds(n.attempts))
    _mark(n, DeliveryStatus.PENDING, now=now, error=failure.error, next_attempt_at=retry_at)
    log.warning("notification %s: attempt %d failed (%s); again at %s", n.pk, n.attempts, failure.error, retry_at)
    return DeliveryStatus.PENDING


def _recipients_now(rows: list[Notification]) -> tuple[set[tuple[int, int]], dict[int, str]]:
    """``({(tenant_id, user_id)} of active members with active accounts, {user_id: saved
    language})`` for the recipients of ``rows``: two queries for the whole batch."""
    users = {n.recipient_id for n in rows}
    members = set(Membership.objects.filter(user_id__in=users, tenant_id__in={n.tenant_id for n in rows},
                                            is_active=True, user__is_active=True)
                  .values_list("tenant_id", "user_id"))
    languages = {u: supported(code) for u, code in
                 LanguagePreference.objects.filter(user_id__in=users).values_list("user_id", "language")}
    return members, {u: code for u, code in languages.items() if code}


def email_message(n: Notification, *, language: str, connection=None) -> EmailMultiAlternatives:
    """Notification ``n``'s e-mail to its recipient in ``language``: the subject and both bodies
    composed in that language (:func:`apps.notifications.compose.email_parts`), the stable
    ``Message-ID`` and ``X-Faultdesk-Notification`` headers (the same at every resend), a task's
    e-mails threaded by ``References`` to the request, and ``Auto-Submitted: auto-generated``
    (RFC 3834: no auto-replies)."""
    with translation.override(language):
        parts = email_parts(n)
    headers = {"Message-ID": n.message_id, "X-Faultdesk-Notification": str(n.pk),
               "Auto-Submitted": "auto-generated", "Content-Language": language}
    if n.task_id:
        thread = f"<task.{n.task_id.hex}@{settings.FAULTDESK['NOTIFY_MESSAGE_ID_DOMAIN']}>"
        headers.update({"References": thread, "In-Reply-To": thread})
    # a subject is one line: line breaks or other control characters from a device's fields fold to spaces
    subject = " ".join("".join(ch if ch.isprintable() else " " for ch in parts.subject).split())
    message = EmailMultiAlternatives(subject=subject, body=parts.text, from_email=settings.DEFAULT_FROM_EMAIL,
                                     to=[n.recipient.email], headers=headers, connection=connection)
    message.attach_alternative(parts.html, "text/html")
    return message


def send_claimed(rows: list[Notification]) -> dict[str, int]:
    """Send each claimed row of ``rows`` (phase 2 and 3, see the module) over one backend
    connection, marking each right after its own send. Returns ``{status: count}`` of the marks
    made (``"lease_expired"`` for rows left unsent because their lease ran out first)."""
    counts: dict[str, int] = {}

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    if not rows:
        return counts
    members, languages = _recipients_now(rows)
    backend = email_connection(fail_silently=False)  # SMTP through the tool gateway (apps/gateway/smtp.py)
    opened = False
    try:
        for n in rows:
            now = timezone.now()
            if n.lease_expires_at is not None and now >= n.lease_expires_at:
                count("lease_expired")  # the next claim sends it; sending now could race it
                continue
            if (n.tenant_id, n.recipient_id) not in members:
                _mark(n, DeliveryStatus.SKIPPED, now=now, error="the recipient is no longer an active member")
                count(DeliveryStatus.SKIPPED)
                continue
            if not n.recipient.email:
                _mark(n, DeliveryStatus.SKIPPED, now=now, error="no e-mail address: page only")
                count(DeliveryStatus.SKIPPED)
                continue
            language = languages.get(n.recipient_id) or settings.LANGUAGE_CODE
            try:
                message = email_message(n, language=language, connection=backend)
                message.message()  # a message that cannot be built (a bad header) never will be
            except Exception as exc:  # noqa: BLE001 - recorded; retrying cannot help
                count(_mark_failed_attempt(n, SendFailure(True, f"cannot build the e-mail: {exc!r}"),
                                           now=timezone.now()))
                continue
            try:
                if not opened:
                    backend.open()
                    opened = True
                failpoint("notify_before_send")
                backend.send_messages([message])
            except Exception as exc:  # noqa: BLE001 - classified, recorded and retried or failed
                count(_mark_failed_attempt(n, failure_of(exc), now=timezone.now()))
                if opened and not isinstance(exc, smtplib.SMTPRecipientsRefused | smtplib.SMTPDataError):
                    _close_quietly(backend)  # a broken conversation: the next row opens a new one
                    opened = False
                continue
            failpoint("notify_after_send")
            if _mark(n, DeliveryStatus.SENT, now=timezone.now(), email_to=n.recipient.email):
                count(DeliveryStatus.SENT)
    finally:
        if opened:
            _close_quietly(backend)
    return counts


def _close_quietly(backend) -> None:
    try:
        backend.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        log.debug("closing the e-mail connection failed", exc_info=True)
