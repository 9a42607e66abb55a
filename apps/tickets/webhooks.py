"""Inbound webhooks from the reference ticket service (DESIGN.md §11).

``POST /webhooks/reference/`` — the only unauthenticated-by-session endpoint; the HMAC signature
is its authentication (format in :mod:`apps.tickets.webhook_signature`). In order:

1. **authenticate**: the signature must verify against ``FAULTDESK["REFSERVICE_WEBHOOK_SECRET"]``
   with a timestamp within ``WEBHOOK_TOLERANCE_SECONDS``; otherwise 401 (a forgery or an old
   replay), logged and not stored (anyone can send one);
2. **parse**: a JSON object with ``event_id``, ``type``, ``ticket_id``, ``idempotency_key``,
   ``version`` and ``status``; otherwise 400 ``MALFORMED``;
3. **deduplicate**: a second verified delivery of the same ``event_id`` → 200 ``DUPLICATE``;
4. **correlate**: the ticket must be the receipt of one of our actions, created with the same
   idempotency key; otherwise 202 ``UNCORRELATED`` (acknowledged so it is not re-sent, and
   changes nothing);
5. **apply**: a version newer than the mirror's updates the mirror's status and version
   (``APPLIED``); an older one is ``STALE`` (webhooks may arrive out of order).

Every authenticated delivery leaves one :class:`~apps.tickets.models.InboundWebhook` row; none touches a task's
event log (a ticket's later life is not a step of the task that created it).
"""

from __future__ import annotations

import json
import logging
import math

from django.conf import settings
from django.db import IntegrityError, transaction
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from apps.core.jsonwalk import strings_of
from apps.tickets.models import InboundWebhook, TicketMirror, WebhookOutcome
from apps.tickets.webhook_signature import verify

log = logging.getLogger(__name__)

SOURCE = "reference"
MAX_BODY_BYTES = 64 * 1024
REQUIRED = ("event_id", "type", "ticket_id", "idempotency_key", "version", "status")


def webhook_receive(*, body: bytes, signature: str | None, now: float | None = None) -> tuple[int, dict]:
    """Process one delivery. Returns ``(http_status, response_body)``; see the module docstring
    for each outcome. Never raises for bad input."""
    ok, why = verify(settings.FAULTDESK["REFSERVICE_WEBHOOK_SECRET"], body, signature,
                     tolerance_seconds=settings.FAULTDESK["WEBHOOK_TOLERANCE_SECONDS"], now=now)
    if not ok:
        return _reject(body, f"signature {why}")
    try:
        event = _parse(body)
        version, event_id = event["version"], event["event_id"]
    except (ValueError, TypeError) as exc:
        InboundWebhook.objects.create(source=SOURCE, verified=False, outcome=WebhookOutcome.MALFORMED,
                                      reason=str(exc)[:300].replace("\x00", ""),
                                      raw_excerpt=body[:1000].decode("utf-8", "replace").replace("\x00", ""))
        log.warning("webhook from %s: malformed (%s)", SOURCE, exc)
        return 400, {"error": "malformed", "detail": str(exc)[:300]}
    try:
        with transaction.atomic():
            return _apply(event, event_id, version)
    except IntegrityError:
        InboundWebhook.objects.create(source=SOURCE, event_id=event_id, verified=True,
                                      outcome=WebhookOutcome.DUPLICATE, reason="already received", body=event)
        log.info("webhook %s: duplicate delivery ignored", event_id)
        return 200, {"status": "duplicate"}


MAX_VERSION = 2**31 - 1


def _parse(body: bytes) -> dict:
    """The event as a dict with checked types: ``version`` an integer 1..2**31-1 (not a bool or
    a float), every other required field a string of at most 200 characters without NUL.
    Raises ``ValueError`` saying what is wrong."""
    try:
        event = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if _holds_nul(event):
        raise ValueError("a string holds a NUL character")
    if not isinstance(event, dict) or any(k not in event for k in REQUIRED):
        raise ValueError(f"a JSON object with {', '.join(REQUIRED)} is required")
    version = event["version"]
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise ValueError(f"version: must be an integer from 1 to {MAX_VERSION}")
    for name in ("event_id", "type", "ticket_id", "idempotency_key", "status"):
        value = event[name]
        if not isinstance(value, str) or not 0 < len(value) <= 200 or "\x00" in value:
            raise ValueError(f"{name}: must be a string of 1..200 characters")
    if "previous_status" in event and not (isinstance(event["previous_status"], str)
                                           and "\x00" not in event["previous_status"]):
        raise ValueError("previous_status: must be a string")
    return event


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _holds_nul(value) -> bool:
    """Whether any key or string in ``value`` (parsed JSON) holds NUL, which PostgreSQL cannot store."""
    return any("\x00" in text for text in strings_of(value))


def _apply(event: dict, event_id: str, version: int) -> tuple[int, dict]:
    mirror = (TicketMirror.objects.select_for_update().select_related("action")
              .filter(connector=SOURCE, external_id=str(event["ticket_id"])).first())
    if mirror is None or mirror.action.idempotency_key != event["idempotency_key"]:
        InboundWebhook.objects.create(source=SOURCE, event_id=event_id, verified=True,
                                      outcome=WebhookOutcome.UNCORRELATED, body=event,
                                      reason="no action of ours created this ticket with this key")
        log.warning("webhook %s: ticket %s is not one of ours; ignored", event_id, event["ticket_id"])
        return 202, {"status": "uncorrelated"}
    row = dict(source=SOURCE, event_id=event_id, verified=True, body=event, tenant_id=mirror.tenant_id,
               action_id=mirror.action_id)
    if version <= mirror.external_version:
        InboundWebhook.objects.create(**row, outcome=WebhookOutcome.STALE,
                                      reason=f"version {version} is not newer than {mirror.external_version}")
        return 200, {"status": "stale"}
    mirror.external_version = version
    mirror.status = str(event["status"])[:32]
    mirror.data = {**(mirror.data or {}), "status": mirror.status, "version": version}
    mirror.save(update_fields=["external_version", "status", "data", "updated_at"])
    InboundWebhook.objects.create(**row, outcome=WebhookOutcome.APPLIED)
    return 200, {"status": "applied"}


def _reject(body: bytes, reason: str) -> tuple[int, dict]:
    """An unauthenticated delivery: logged (reason and size), never stored — anyone can send
    these, and a row per request would let them fill the database."""
    log.warning("webhook from %s rejected: %s (%d bytes, not stored)", SOURCE, reason, len(body))
    return 401, {"error": "invalid_signature", "detail": reason}


@csrf_exempt
@require_POST
def reference_webhook(request):
    """The HTTP endpoint; see :func:`webhook_receive`. Bodies over 64 KiB get 413 (a malformed
    Content-Length is refused before, by ``RejectMalformedRequestsMiddleware``)."""
    if int(request.META.get("CONTENT_LENGTH") or 0) > MAX_BODY_BYTES:
        return JsonResponse({"error": "payload_too_large"}, status=413)
    status, body = webhook_receive(body=request.body, signature=request.headers.get("X-Refservice-Signature"))
    return JsonResponse(body, status=status)
