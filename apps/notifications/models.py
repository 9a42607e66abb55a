"""Notifications: each one is a row of its own outbox (issue "notifications"; DESIGN.md §6's
transactional outbox applied to people).

A row is written in the transaction of the task event that caused it (:mod:`.projections`), so it
exists exactly when the event does: a rolled-back event notifies nobody, a committed one is never
lost, and the unique key ``(source_event_id, recipient, kind)`` keeps a replayed or retried
projection from making a second row. The same row is

* the **page** notification (the bell and ``/notifications/``): shown once committed, read when
  ``read_at`` is set;
* the **e-mail**, whose delivery ``status`` is driven by :mod:`.sending` — claimed with a lease and
  a fencing token (``lease_generation``), sent through Django's e-mail backend, marked ``SENT``
  after the SMTP server accepted it, retried with backoff, ``FAILED`` after
  ``FAULTDESK["NOTIFY_MAX_ATTEMPTS"]``.

Approvers' items wait (``HELD``) for their digest: one e-mail (a row of kind ``approval_digest``)
lists everything waiting for that approver, and the items it carried become ``DIGESTED`` in the
transaction that writes it (:mod:`.digests`).

Every message carries the stable ``message_id`` derived from the row's id: a resend after a crash
between the SMTP server's acceptance and the ``SENT`` mark is the same message to a receiver that
deduplicates by Message-ID.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class NotificationKind(models.TextChoices):
    """What a notification tells its recipient."""

    #: the requester: the agent asks a question (the task waits for the answer)
    INPUT_REQUESTED = "input_requested", _("The agent asks a question")
    #: the requester: the ticket exists, with its id
    TICKET_CREATED = "ticket_created", _("Ticket created")
    #: the requester: the report was added to another report's open ticket
    REPORT_JOINED = "report_joined", _("Report added to an open ticket")
    #: the requester: the request ended (completed, failed or cancelled), with the reason
    TASK_ENDED = "task_ended", _("Request ended")
    #: an approver: a proposal (or the closing of a ticket after a cancel) waits for a decision
    APPROVAL_WAITING = "approval_waiting", _("Waiting for your approval")
    #: an approver: the one e-mail listing the approval items held for the digest window
    APPROVAL_DIGEST = "approval_digest", _("Approvals waiting (digest)")


class DeliveryStatus(models.TextChoices):
    """Where a notification's e-mail stands."""

    #: an approver's item, waiting for the recipient's next digest
    HELD = "HELD", _("Held for the digest")
    #: to be sent (at ``next_attempt_at``)
    PENDING = "PENDING", _("Pending")
    #: claimed by a sender whose lease runs until ``lease_expires_at``
    SENDING = "SENDING", _("Sending")
    #: the SMTP server accepted it
    SENT = "SENT", _("Sent")
    #: given up: a permanent refusal, or ``NOTIFY_MAX_ATTEMPTS`` attempts
    FAILED = "FAILED", _("Failed")
    #: went out inside a digest (``digest``)
    DIGESTED = "DIGESTED", _("Sent in a digest")
    #: no e-mail: the page only (no address, a deactivated account, or nothing waiting any more)
    SKIPPED = "SKIPPED", _("Page only")


#: the statuses the senders claim from
CLAIMABLE = (DeliveryStatus.PENDING, DeliveryStatus.SENDING)


class Notification(models.Model):
    """One notification to one person about one task (or, for a digest, several tasks of one
    tenant). ``context`` is data, never text: the words are composed when it is sent or shown, in
    the reader's language (:mod:`.compose`). Shapes of ``context`` by kind:

    * ``input_requested``: ``{"questions": [str], "asset_tag": str}``
    * ``ticket_created``: ``{"ticket": str, "asset_tag": str}``
    * ``report_joined``: ``{"ticket": str, "comment": str, "asset_tag": str}``
    * ``task_ended``: ``{"status": "COMPLETED"|"FAILED"|"CANCELLED", "reason": str, "ticket": str|None,
      "asset_tag": str}``
    * ``approval_waiting``: ``{"approval_id": str, "tool": str, "compensation": bool, "ticket": str|None,
      "asset_tag": str, "expires_at": ISO datetime}``
    * ``approval_digest``: ``{"items": [the items' ``approval_waiting`` contexts plus "task_id"]}``
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="notifications")
    recipient = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notifications")
    kind = models.CharField(max_length=32, choices=NotificationKind.choices)
    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, null=True, blank=True,
                             related_name="notifications", help_text="empty for a digest")
    source_event_id = models.UUIDField(null=True, blank=True, help_text="the task event that caused it")
    source_event_seq = models.PositiveIntegerField(null=True, blank=True)
    context = models.JSONField(default=dict)
    # the page channel
    on_page = models.BooleanField(default=True, help_text="shown in the bell and the notifications page")
    read_at = models.DateTimeField(null=True, blank=True)
    # the e-mail channel: an outbox row of its own
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    message_id = models.CharField(max_length=200, help_text="the e-mail's Message-ID, the same at every resend")
    email_to = models.CharField(max_length=254, blank=True, help_text="the address it was last sent to")
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_generation = models.PositiveIntegerField(default=0, help_text="fencing token, one more at every claim")
    last_error = models.TextField(blank=True)
    digest = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="items",
                               help_text="the digest e-mail that carried this item")
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    # Retention (apps.notifications.retention): set when the free text of a finished notification's
    # ``context`` (questions, reasons) was emptied past the tenant's policy; the rest stays.
    purged_at = models.DateTimeField(null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("notification")
        verbose_name_plural = _("notifications")
        ordering = ["-created_at"]
        constraints = [
            # a projection run again for the same event (a retried or replayed commit) adds nothing
            models.UniqueConstraint(fields=["source_event_id", "recipient", "kind"],
                                    condition=Q(source_event_id__isnull=False), name="notification_once_per_event"),
        ]
        indexes = [
            # the senders' claim: due rows only
            models.Index(fields=["next_attempt_at"], name="notification_due_idx",
                         condition=Q(status__in=["PENDING", "SENDING"])),
            # the digest builder: held items per recipient
            models.Index(fields=["recipient", "tenant", "created_at"], name="notification_held_idx",
                         condition=Q(status="HELD")),
            # the bell and the page: a person's newest
            models.Index(fields=["recipient", "tenant", "-created_at"], name="notification_inbox_idx",
                         condition=Q(on_page=True)),
        ]

    def __str__(self) -> str:
        return f"{self.kind} to {self.recipient_id} ({self.status})"
