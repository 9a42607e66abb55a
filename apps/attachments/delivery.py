"""Sending a report's attachments to its ticket: an outbox of its own.

The approved write (``ticket.create``, or the ``ticket.comment`` a report that joined an open
ticket becomes) carries the attachments' names, types, sizes and digests in its parameters, so the
approver approved exactly those files. When the write's receipt is recorded,
:func:`deliveries_on_receipt` — a projection run inside that event's transaction — writes one
:class:`~apps.attachments.models.AttachmentDelivery` per file and ticket; nothing is sent for a
receipt that is not committed. :func:`deliveries_drain` (a Celery task kicked on commit, and a
beat tick for anything left behind by a crash) claims due rows with ``FOR UPDATE SKIP LOCKED``
under a lease and a fencing token, checks the stored bytes still hash to the approved digest, and
sends them through the ticket's connector (``attach``: idempotent by the digest at the reference
service, looked up before sending at django-helpdesk), so a retry after a crash or a lost answer
never attaches a file twice. A refusal (no such ticket, bad request, no permission) or
``ATTACHMENT_DELIVERY_MAX_ATTEMPTS`` failed attempts mark the row FAILED with its reason; the task
page and the trace show every row's state.
"""

from __future__ import annotations

import hashlib
import logging
import random
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.attachments.models import Attachment, AttachmentDelivery, DeliveryStatus
from apps.attachments.selectors import attachment_bytes
from apps.core import tool_errors as errors
from apps.core.failpoints import failpoint
from apps.core.queue import DELIVER_ATTACHMENTS, enqueue_on_commit
from apps.tickets.connectors import CONNECTORS
from config.logs import bound

log = logging.getLogger(__name__)

#: the most rows one drain claims at a time (under one lease: a few, so each is sent well within it)
BATCH = 5


def deliveries_on_receipt(task, event, new_state: dict) -> None:
    """Projection (:func:`apps.tasks.store.projection_register`): on the ``receipt.recorded`` of a
    task's write (not a compensation's) whose parameters carry attachments, write one PENDING
    delivery per attachment to the ticket the receipt names (the new ticket, or the one commented
    on), and kick the sender on commit. Other events cost no query."""
    if event.type != "receipt.recorded":
        return
    receipt = new_state.get("receipt")
    if not receipt or (task.state or {}).get("receipt") is not None or receipt.get("kind") == "update":
        return  # a compensation's receipt leaves the write's receipt as it was
    files = ((new_state.get("proposal") or {}).get("params") or {}).get("attachments") or []
    if not files:
        return
    ticket_id = receipt.get("ticket_id") or receipt["external_id"]
    connector = receipt.get("connector") or "reference"
    approved = {f["sha256"] for f in files}
    now = timezone.now()
    rows = Attachment.objects.for_tenant(task.tenant_id).filter(task_id=task.pk, sha256__in=approved)
    AttachmentDelivery.objects.bulk_create(
        [AttachmentDelivery(tenant_id=task.tenant_id, attachment=a, connector=connector, ticket_id=ticket_id,
                            available_at=now) for a in rows],
        ignore_conflicts=True,
    )
    enqueue_on_commit(DELIVER_ATTACHMENTS)


def _claim(owner: str) -> list[AttachmentDelivery]:
    """Claim up to :data:`BATCH` due rows (PENDING and available, or IN_FLIGHT with a lapsed lease):
    each gets a new fencing token and a lease; committed before anything is sent."""
    now = timezone.now()
    lease = settings.FAULTDESK["ATTACHMENT_DELIVERY_LEASE_SECONDS"]
    with transaction.atomic():
        due = list(
            AttachmentDelivery.objects
            .filter(status__in=[DeliveryStatus.PENDING, DeliveryStatus.IN_FLIGHT], available_at__lte=now)
            .exclude(status=DeliveryStatus.IN_FLIGHT, lease_expires_at__gt=now)
            .order_by("available_at")
            .select_for_update(skip_locked=True)[:BATCH]
        )
        for row in due:
            row.status = DeliveryStatus.IN_FLIGHT
            row.lease_owner = owner
            row.lease_generation += 1
            row.lease_expires_at = now + timedelta(seconds=lease)
            row.available_at = row.lease_expires_at  # a crashed sender's row is due again when its lease lapses
            row.attempts += 1
            row.save(update_fields=["status", "lease_owner", "lease_generation", "lease_expires_at", "available_at",
                                    "attempts"])
    return due


def _settle(row: AttachmentDelivery, **changes) -> bool:
    """Write ``changes`` to ``row`` if it is still ours (its fencing token unchanged). Returns
    whether it was: a sender whose lease lapsed and was claimed again writes nothing."""
    return bool(AttachmentDelivery.objects.filter(pk=row.pk, lease_generation=row.lease_generation,
                                                   status=DeliveryStatus.IN_FLIGHT).update(**changes))


def _send(row: AttachmentDelivery) -> None:
    attachment = Attachment.objects.get(pk=row.attachment_id)
    try:
        data = attachment_bytes(attachment)
    except FileNotFoundError:
        _settle(row, status=DeliveryStatus.FAILED, last_error="the stored file is missing", lease_owner="")
        return
    if hashlib.sha256(data).hexdigest() != attachment.sha256:
        # never send bytes other than the ones approved
        _settle(row, status=DeliveryStatus.FAILED, lease_owner="",
                last_error="the stored file no longer matches the approved digest; not sent")
        return
    connector = CONNECTORS[row.connector]()
    # Send only while the lease outlasts the whole send (helpdesk's is a lookup and a post, each up to
    # the connector's timeout): once it could lapse mid-send, another sender may claim the row, and
    # two sends of one file could both miss the lookup. A row with too little lease left is handed back.
    left = (row.lease_expires_at - timezone.now()).total_seconds()
    if left < 2 * connector.timeout + 1:
        log.info("attachment delivery %s: %.1f s of lease left, less than a send may take; handed back",
                 row.pk, left)
        _settle(row, status=DeliveryStatus.PENDING, lease_owner="", lease_expires_at=None,
                available_at=timezone.now(), attempts=row.attempts - 1)  # not an attempt: nothing was sent
        return
    failpoint("attachment_before_send")
    try:
        with bound(tenant_id=row.tenant_id, task_id=attachment.task_id):  # the gateway records the call with them
            remote_id = connector.attach(ticket_id=row.ticket_id, name=attachment.name,
                                         content_type=attachment.content_type, data=data, sha256=attachment.sha256,
                                         timeout=connector.timeout)
    except (errors.InvalidParams, errors.Unauthorized, errors.PreconditionFailed) as exc:
        _settle(row, status=DeliveryStatus.FAILED, last_error=f"{type(exc).__name__}: {exc}"[:500], lease_owner="")
        return
    except errors.ToolError as exc:
        _retry_later(row, f"{type(exc).__name__}: {exc}")
        return
    failpoint("attachment_after_send")
    _settle(row, status=DeliveryStatus.DELIVERED, remote_id=remote_id[:200], delivered_at=timezone.now(),
            last_error="", lease_owner="", lease_expires_at=None)


def _retry_later(row: AttachmentDelivery, error: str) -> None:
    if row.attempts >= settings.FAULTDESK["ATTACHMENT_DELIVERY_MAX_ATTEMPTS"]:
        _settle(row, status=DeliveryStatus.FAILED, last_error=f"gave up after {row.attempts} attempts: {error}"[:500],
                lease_owner="")
        return
    base = settings.FAULTDESK.get("RETRY_BACKOFF_BASE_SECONDS", 1.0)
    delay = random.uniform(0, min(300.0, base * 2 ** row.attempts))  # noqa: S311 - jitter, not security
    _settle(row, status=DeliveryStatus.PENDING, last_error=error[:500], lease_owner="", lease_expires_at=None,
            available_at=timezone.now() + timedelta(seconds=delay))


def deliveries_drain(owner: str = "attachments", *, max_rounds: int = 50) -> int:
    """Send every due delivery (see the module docstring); returns how many rows were claimed.
    Errors of one row never stop the others (each is logged and retried later)."""
    claimed = 0
    for _round in range(max_rounds):
        rows = _claim(owner)
        if not rows:
            break
        claimed += len(rows)
        for row in rows:
            try:
                _send(row)
            except Exception as exc:  # noqa: BLE001 - one row's failure is retried, the others go on
                log.exception("attachment delivery %s failed", row.pk)
                _retry_later(row, f"unexpected: {exc!r}")
    return claimed
