"""The approvers' digest: one e-mail listing everything waiting for one approver, instead of one
e-mail per approval: approvers are told when something waits for them, with a digest instead of a
flood.

Each approval item (``approval_waiting``) is ``HELD`` when written. :func:`digests_build` turns the
held items of one approver in one tenant into one digest row (kind ``approval_digest``, sent like
any other notification) and marks the items ``DIGESTED`` with it — both in one transaction, so a
crash leaves either the items held (built again next time) or the digest written with its items
(sent by the next sender): never an item lost or mailed twice.

When: leading edge, then at most one per window. The first item after a quiet period goes out at
the next run of the sender — at once, since the item's commit kicks it; later items wait until
``FAULTDESK["NOTIFY_DIGEST_SECONDS"]`` (default 300) after that approver's previous digest, and then
go out together. An approver is told promptly that something waits, and a burst of fifty proposals
makes two e-mails, not fifty.

A digest lists only what still waits when it is built: an item whose approval was decided, expired
or invalidated meanwhile is not mailed (it stays on the page, ``SKIPPED`` for e-mail). A digest is
of one tenant: a person who is a member of two gets one per tenant, never another tenant's task in
one.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max, Min
from django.utils import timezone

from apps.accounts.models import Membership
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.projections import DEFAULT_APPROVER_ROLES, message_id_for

log = logging.getLogger(__name__)


def digests_build(*, now=None) -> int:
    """Build the digest of every (tenant, approver) whose held items are due (see the module).
    Returns how many digests were written. Two queries when nothing is held, plus one transaction
    per due approver."""
    now = now or timezone.now()
    held = list(Notification.objects.filter(status=DeliveryStatus.HELD)
                .values_list("tenant_id", "recipient_id").annotate(first=Min("created_at")))
    if not held:
        return 0
    last = {(t, r): at for t, r, at in Notification.objects.filter(
        kind=NotificationKind.APPROVAL_DIGEST, recipient_id__in={r for _, r, _ in held})
        .values_list("tenant_id", "recipient_id").annotate(last=Max("created_at"))}
    built = 0
    for tenant_id, recipient_id, _first in held:
        if _window_open(last.get((tenant_id, recipient_id)), now):
            built += digest_build_one(tenant_id=tenant_id, recipient_id=recipient_id, now=now)
    return built


def _window_open(last_digest_at, now) -> bool:
    """Whether a digest may go out now after one built at ``last_digest_at`` (None: none yet)."""
    window = timedelta(seconds=settings.FAULTDESK["NOTIFY_DIGEST_SECONDS"])
    return last_digest_at is None or last_digest_at <= now - window


def _lock_key(tenant_id: int, recipient_id: int) -> int:
    """A 64-bit advisory lock key for one approver's digests in one tenant."""
    digest = hashlib.sha256(f"faultdesk:notify-digest:{tenant_id}:{recipient_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def digest_build_one(*, tenant_id: int, recipient_id: int, now=None) -> int:
    """In one transaction: under the approver's advisory lock (another builder holding it: 0,
    nothing done), re-check the window, lock the approver's held items of ``tenant_id``, mark those
    whose approval no longer waits ``SKIPPED``, and write the digest of the others (``PENDING``,
    due now) with the items ``DIGESTED`` under it. Returns 1 when a digest was written, else 0."""
    now = now or timezone.now()
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_lock_key(tenant_id, recipient_id)])
            if not cursor.fetchone()[0]:
                return 0
        last = (Notification.objects.for_tenant(tenant_id)
                .filter(kind=NotificationKind.APPROVAL_DIGEST, recipient_id=recipient_id)
                .aggregate(last=Max("created_at"))["last"])
        if not _window_open(last, now):
            return 0
        items = list(Notification.objects.for_tenant(tenant_id)
                     .filter(recipient_id=recipient_id, status=DeliveryStatus.HELD)
                     .select_for_update(skip_locked=True).order_by("created_at", "pk"))
        if not items:
            return 0
        # still waiting, and still the recipient's to decide (a role changed since is no longer asked)
        role = (Membership.objects.for_tenant(tenant_id)
                .filter(user_id=recipient_id, is_active=True, user__is_active=True)
                .values_list("role", flat=True).first())
        waiting = {str(pk) for pk, roles in ApprovalRequest.objects.for_tenant(tenant_id).filter(
            pk__in=[i.context.get("approval_id") for i in items], status=ApprovalStatus.PENDING,
            expires_at__gt=now).values_list("pk", "approver_roles")
            if role is not None and role in (roles or DEFAULT_APPROVER_ROLES)}
        listed = [i for i in items if i.context.get("approval_id") in waiting]
        gone = [i.pk for i in items if i.context.get("approval_id") not in waiting]
        if gone:
            Notification.objects.filter(pk__in=gone).update(status=DeliveryStatus.SKIPPED,
                                                            last_error="no longer waiting for this recipient when the "
                                                                       "digest was built")
        if not listed:
            return 0
        digest = Notification(tenant_id=tenant_id, recipient_id=recipient_id, kind=NotificationKind.APPROVAL_DIGEST,
                              on_page=False, status=DeliveryStatus.PENDING, next_attempt_at=now,
                              context={"items": [{**i.context, "task_id": str(i.task_id)} for i in listed]})
        digest.message_id = message_id_for(digest.pk)
        digest.save(force_insert=True)
        Notification.objects.filter(pk__in=[i.pk for i in listed]).update(status=DeliveryStatus.DIGESTED,
                                                                          digest=digest)
    log.info("digest %s for user %s of tenant %s lists %d approvals", digest.pk, recipient_id, tenant_id, len(listed))
    return 1
