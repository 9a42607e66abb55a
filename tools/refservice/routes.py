"""Routes of the reference ticket service: the request and response shapes and one plain function
per endpoint, ``handler(server, request) -> Response | None`` (``None``: close the connection
without answering — the lost-response fault). The API is documented in the package docstring
(:mod:`tools.refservice`); the HTTP layer is :mod:`.server`.
"""

import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import store as storage
from .validation import (
    ApiError,
    body_digest,
    invalid,
    parse_fencing_token,
    parse_idempotency_key,
    parse_if_match,
    parse_json_object,
    validate_comment,
    validate_create,
    validate_faults,
    validate_patch,
)

log = logging.getLogger(__name__)

#: the largest request body accepted (413 above it)
MAX_BODY_BYTES = 1024 * 1024


@dataclass
class Request:
    """A parsed request as route handlers see it.

    ``query`` maps each query parameter to its first value; ``params`` holds the
    named groups of the route pattern (e.g. ``ticket_id``); ``body`` is raw bytes.
    """

    method: str
    path: str
    query: dict
    headers: object
    body: bytes
    params: dict


@dataclass
class Response:
    """A JSON response: HTTP ``status``, ``body`` (serialised to JSON) and extra ``headers``."""

    status: int
    body: object
    headers: dict = field(default_factory=dict)


@contextmanager
def _store_errors():
    """Turn the store's refusals into their HTTP answers (none of them changed anything)."""
    try:
        yield
    except storage.NotFound:
        raise ApiError(404, "not_found") from None
    except storage.VersionMismatch as exc:
        raise ApiError(412, "version_mismatch", headers={"ETag": f'"{exc.current_version}"'},
                       current_version=exc.current_version) from None
    except storage.StaleFencingToken as exc:
        raise ApiError(409, "stale_fencing_token", highest=exc.highest) from None
    except storage.FencingTokenRequired:
        raise ApiError(409, "fencing_token_required",
                       detail="this Idempotency-Key was fenced: send X-Fencing-Token") from None
    except storage.IdempotencyKeyReused:
        raise ApiError(422, "idempotency_key_reused",
                       detail="this Idempotency-Key was already used with a different request body") from None


def _ticket_response(status, ticket, **headers):
    return Response(status, ticket, {"ETag": f'"{ticket["version"]}"', **headers})


# --- route handlers ---------------------------------------------------------------------------


def healthz(server, request):
    """``GET /healthz`` -> 200 ``{"ok": true}`` (no authentication)."""
    return Response(200, {"ok": True})


def create_ticket(server, request):
    """``POST /tickets``: idempotent, fenced ticket creation, with injected faults applied.

    Validates headers and body first (400s use up no fault), then runs as a
    :func:`_keyed_write` (409 while the key is in flight, the next armed fault).
    """
    key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
    server.count_request(key)
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    payload = parse_json_object(request.body)
    fields = validate_create(payload)
    digest = body_digest(payload)

    def create():
        with _store_errors():
            result = server.store.create_ticket(key, digest, fields, fencing_token)
        headers = {"Location": f"/tickets/{result.body['id']}"}
        if result.replayed:
            headers["Idempotent-Replayed"] = "true"
        return _ticket_response(result.status, result.body, **headers)

    return _keyed_write(server, key, "POST /tickets", create)


#: the most creates one ``POST /ticket-batches`` may carry (400 above it)
MAX_BATCH_ITEMS = 100


def create_tickets_batch(server, request):
    """``POST /ticket-batches``: several creates in one request, each exactly as its own
    ``POST /tickets`` would be — its own idempotency key, fencing token, body digest, store
    transaction, in-progress refusal and armed fault — so a create first sent in a batch and
    resent alone (or the other way round) is the same request and replays.

    Body ``{"items": [{"idempotency_key": str, "fencing_token": int | null, "ticket": {create
    body}}, ...]}`` with 1..:data:`MAX_BATCH_ITEMS` items and no key twice. A malformed batch gets
    400 and nothing happens. Otherwise 200 ``{"results": [...]}``, one per item in the order sent:
    ``{"idempotency_key", "status": 201, "replayed": bool, "ticket": ticket}`` or
    ``{"idempotency_key", "status": 4xx/503, "error", ...}`` (the answer ``POST /tickets`` would
    have given). A ``drop_after_commit`` fault taken by any item closes the connection unanswered
    after every item was processed (the lost answer of a whole batch)."""
    payload = parse_json_object(request.body)
    if set(payload) != {"items"} or not isinstance(payload["items"], list):
        raise invalid('body must be {"items": [...]}')
    items = payload["items"]
    if not 1 <= len(items) <= MAX_BATCH_ITEMS:
        raise invalid(f"items: 1..{MAX_BATCH_ITEMS} creates per batch")
    parsed = []
    for number, item in enumerate(items):
        if not isinstance(item, dict) or set(item) - {"idempotency_key", "fencing_token", "ticket"}:
            raise invalid(f"items[{number}]: must be an object with idempotency_key, fencing_token, ticket")
        key = item.get("idempotency_key")
        key = parse_idempotency_key(key if isinstance(key, str) else None)
        token = item.get("fencing_token")
        if token is not None and (isinstance(token, bool) or not isinstance(token, int)):
            raise invalid(f"items[{number}].fencing_token: must be a non-negative integer or null")
        token = parse_fencing_token(None if token is None else str(token))
        parsed.append((key, token, item.get("ticket")))
    if len({key for key, _, _ in parsed}) != len(parsed):
        raise invalid("items: an idempotency key appears twice")
    results, dropped = [], False
    for key, token, ticket in parsed:
        server.count_request(key)
        try:
            if not isinstance(ticket, dict):
                raise invalid("ticket: must be a JSON object")
            fields = validate_create(ticket)

            def create(key=key, token=token, ticket=ticket, fields=fields):
                with _store_errors():
                    return server.store.create_ticket(key, body_digest(ticket), fields, token)

            result, fault = _keyed_write_result(server, key, "POST /ticket-batches", create)
        except ApiError as exc:
            results.append({"idempotency_key": key, "status": exc.status, **exc.body})
            continue
        if fault == "fail_503":
            results.append({"idempotency_key": key, "status": 503, "error": "temporarily_unavailable"})
            continue
        dropped = dropped or fault == "drop_after_commit"
        results.append({"idempotency_key": key, "status": result.status, "replayed": result.replayed,
                        "ticket": result.body})
    if dropped:
        log.warning("fault drop_after_commit: committed a batch of %d, dropping the response", len(parsed))
        return None
    return Response(200, {"results": results})


def _keyed_write_result(server, key, what, write):
    """Run ``write()`` for a write carrying idempotency ``key`` under the key's in-progress mark
    and the next armed fault. Returns ``(what write() returned, the fault mode taken or None)``;
    under ``fail_503`` write() is not run and the result is None. Raises 409
    ``request_in_progress`` while another request with the key is being processed."""
    if not server.key_begin(key):
        # Another request with this key is being processed: its outcome is not known yet.
        raise ApiError(409, "request_in_progress", headers={"Retry-After": "1"},
                       detail="a request with this Idempotency-Key is in progress; retry later with the same key")
    try:
        fault = server.faults.take()
        if fault and fault.mode == "fail_503":
            log.warning("fault fail_503: rejecting %s key=%s", what, key)
            return None, fault.mode
        if fault and fault.mode == "delay":
            time.sleep(fault.delay_seconds)
        return write(), (fault.mode if fault else None)
    finally:
        server.key_end(key)


def _keyed_write(server, key, what, write):
    """Run ``write()`` (which returns the :class:`Response`) for a request carrying idempotency
    ``key``: 409 ``request_in_progress`` while another request with the key is being processed,
    and the next armed fault applied — ``fail_503`` answers 503 without touching storage,
    ``delay`` sleeps first, ``drop_after_commit`` commits and returns None (the connection is
    closed unanswered)."""
    response, fault = _keyed_write_result(server, key, what, write)
    if fault == "fail_503":
        return Response(503, {"error": "temporarily_unavailable"}, {"Retry-After": "1"})
    if fault == "drop_after_commit":
        log.warning("fault drop_after_commit: committed %s key=%s, dropping the response", what, key)
        return None
    return response


def fence_key(server, request):
    """``POST /fences`` with ``Idempotency-Key`` and ``X-Fencing-Token`` (both required): raise the
    key's highest fencing token, whether or not a ticket exists for it, and answer 200
    ``{"idempotency_key", "highest_fencing_token", "ticket": ticket | null}``. A token below the
    stored maximum gets 409 ``stale_fencing_token`` and changes nothing."""
    key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    if fencing_token is None:
        raise invalid("X-Fencing-Token: required for a fence")
    try:
        result = server.store.fence(key, fencing_token)
    except storage.StaleFencingToken as exc:
        raise ApiError(409, "stale_fencing_token", highest=exc.highest) from None
    return Response(200, {"idempotency_key": key, "highest_fencing_token": result.highest_fencing_token,
                          "ticket": result.ticket, "comment": result.comment, "update": result.update})


def add_comment(server, request):
    """``POST /tickets/<id>/comments``: a comment, exactly once per ``Idempotency-Key``.

    Body ``{"body": str}`` (1..20000 characters). ``If-Match`` (optional) makes it conditional
    on the ticket's version (412 ``version_mismatch``); ``X-Fencing-Token`` as for creates.
    201 ``{"comment", "ticket_id", "ticket_version"}`` (with ``Idempotent-Replayed: true`` for a
    replay), 404, 409, 412 or 422 (the key was used with another body or ticket)."""
    key = parse_idempotency_key(request.headers.get("Idempotency-Key"))
    server.count_request(key)
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    if_match = request.headers.get("If-Match")
    expected_version = parse_if_match(if_match) if if_match is not None else None
    payload = parse_json_object(request.body)
    body = validate_comment(payload)

    def comment():
        with _store_errors():
            result = server.store.add_comment(request.params["ticket_id"], key, body_digest(payload), body,
                                              expected_version, fencing_token)
        headers = {"ETag": f'"{result.body["ticket_version"]}"'}
        if result.replayed:
            headers["Idempotent-Replayed"] = "true"
        return Response(201, result.body, headers)

    return _keyed_write(server, key, "POST comment", comment)


def _query_key(request) -> str:
    """The ``idempotency_key`` query parameter of a lookup; 400 ``invalid`` when it is missing."""
    key = request.query.get("idempotency_key")
    if not key:
        raise invalid("query parameter idempotency_key is required")
    return key


def lookup_comments(server, request):
    """``GET /tickets/<id>/comments?idempotency_key=K`` -> 200 ``{"results": [comment response]}``."""
    key = _query_key(request)
    found = server.store.find_comment_by_key(request.params["ticket_id"], key)
    return Response(200, {"results": [found] if found else []})


def lookup_tickets(server, request):
    """``GET /tickets?idempotency_key=K`` -> 200 ``{"results": [ticket]}`` (0 or 1 entries)."""
    key = _query_key(request)
    ticket = server.store.find_by_idempotency_key(key)
    return Response(200, {"results": [ticket] if ticket else []})


def get_ticket(server, request):
    """``GET /tickets/<id>`` -> 200 ticket with ``ETag``, or 404 ``not_found``."""
    ticket = server.store.get_ticket(request.params["ticket_id"])
    if ticket is None:
        raise ApiError(404, "not_found")
    return _ticket_response(200, ticket)


def patch_ticket(server, request):
    """``PATCH /tickets/<id>`` with ``If-Match``: 200 new version, 404, 412 or 428. With an
    ``Idempotency-Key`` (optional) the update happens once per key: the same key again replays
    the stored ticket (``Idempotent-Replayed: true``), the key with another body or ticket gets
    422; ``X-Fencing-Token`` as for creates."""
    expected_version = parse_if_match(request.headers.get("If-Match"))
    raw_key = request.headers.get("Idempotency-Key")
    key = parse_idempotency_key(raw_key) if raw_key is not None else None
    if key is not None:
        server.count_request(key)
    fencing_token = parse_fencing_token(request.headers.get("X-Fencing-Token"))
    payload = parse_json_object(request.body)
    changes = validate_patch(payload)

    def update():
        with _store_errors():
            result = server.store.update_ticket(request.params["ticket_id"], expected_version, changes, key,
                                                body_digest(payload), fencing_token)
        if server.webhooks is not None:
            server.webhooks.wake()
        headers = {"Idempotent-Replayed": "true"} if result.replayed else {}
        return _ticket_response(200, result.body, **headers)

    return update() if key is None else _keyed_write(server, key, "PATCH", update)


def lookup_updates(server, request):
    """``GET /tickets/<id>/updates?idempotency_key=K`` -> 200 ``{"results": [ticket as that
    update left it]}`` (0 or 1 entries)."""
    key = _query_key(request)
    found = server.store.find_update_by_key(request.params["ticket_id"], key)
    return Response(200, {"results": [found] if found else []})


def admin_effects(server, request):
    """``GET /_admin/effects?idempotency_key=K`` -> ``{"idempotency_key": K, "effects": N,
    "requests": M}``: tickets really created for K (0 or 1), and ``POST /tickets`` requests with K
    received since the process started (whatever their answer)."""
    key = _query_key(request)
    return Response(200, {"idempotency_key": key, "effects": server.store.effects(key),
                          "requests": server.requests_for(key)})


def admin_tickets(server, request):
    """``GET /_admin/tickets`` -> ``{"results": [every ticket, oldest first]}``."""
    return Response(200, {"results": server.store.list_tickets()})


def admin_webhooks(server, request):
    """``GET /_admin/webhooks`` -> ``{"results": [{"event_id", "body", "attempts", "delivered_at",
    "last_status"}]}``, oldest first."""
    return Response(200, {"results": server.store.list_webhooks()})


def admin_faults(server, request):
    """``POST /_admin/faults`` -> arm a fault; 200 ``{"mode", "remaining", "delay_seconds"}``."""
    mode, count, delay_seconds = validate_faults(parse_json_object(request.body))
    state = server.faults.arm(mode, count, delay_seconds)
    log.info("faults armed: %s", state)
    return Response(200, state)


def admin_reset(server, request):
    """``POST /_admin/reset`` -> wipe tickets, keys and faults; 200 ``{"ok": true}``."""
    server.store.reset()
    server.faults.clear()
    log.info("reset: all tickets, idempotency keys and faults wiped")
    return Response(200, {"ok": True})


#: the largest attachment ``PUT /tickets/<id>/attachments/<sha256>`` takes (413 above it)
MAX_ATTACHMENT_BYTES = 32 * 1024 * 1024
#: the content types an attachment may have
ATTACHMENT_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp", "application/pdf", "text/plain"})


def put_attachment(server, request):
    """``PUT /tickets/<id>/attachments/<sha256>``: attach the body's bytes to the ticket, once per
    digest. Headers: ``Content-Type`` (one of :data:`ATTACHMENT_TYPES`) and ``X-Filename`` (the name,
    percent-encoded UTF-8, 1..200 characters, no path). 201 ``{"ticket_id", "sha256", "filename",
    "content_type", "size", "created_at"}`` when stored, 200 with the stored record (and
    ``Idempotent-Replayed: true``) when the ticket already has these bytes, 400 ``invalid_params``
    when the bytes do not hash to ``sha256`` or a header is wrong, 404 for no such ticket."""
    import hashlib
    from urllib.parse import unquote

    sha256 = request.params["sha256"]
    if hashlib.sha256(request.body).hexdigest() != sha256:
        raise invalid("the body's SHA-256 is not the one in the path")
    content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
    if content_type not in ATTACHMENT_TYPES:
        raise invalid(f"Content-Type: must be one of {', '.join(sorted(ATTACHMENT_TYPES))}")
    try:
        filename = unquote(request.headers.get("X-Filename") or "", errors="strict")
    except UnicodeDecodeError:
        raise invalid("X-Filename: must be percent-encoded UTF-8") from None
    if not (0 < len(filename) <= 200) or "/" in filename or "\\" in filename or filename.startswith("."):
        raise invalid("X-Filename: a plain file name of 1..200 characters")
    with _store_errors():
        record, created = server.store.add_attachment(request.params["ticket_id"], sha256, filename, content_type,
                                                      request.body)
    return Response(201 if created else 200, record, {} if created else {"Idempotent-Replayed": "true"})


def list_attachments(server, request):
    """``GET /tickets/<id>/attachments`` -> 200 ``{"results": [attachment record]}`` (oldest first;
    the records, not the bytes), 404 for no such ticket."""
    with _store_errors():
        return Response(200, {"results": server.store.list_attachments(request.params["ticket_id"])})


@dataclass(frozen=True)
class Route:
    """A path ``pattern`` (full match), its ``methods`` (name -> handler), whether it is ``public``
    and the largest body it takes (``max_body`` bytes)."""

    pattern: re.Pattern
    methods: dict
    public: bool = False
    #: the largest body the route takes (413 above it)
    max_body: int = MAX_BODY_BYTES


ROUTES = (
    Route(re.compile(r"/healthz"), {"GET": healthz}, public=True),
    Route(re.compile(r"/tickets"), {"GET": lookup_tickets, "POST": create_ticket}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)"), {"GET": get_ticket, "PATCH": patch_ticket}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)/comments"), {"GET": lookup_comments, "POST": add_comment}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)/updates"), {"GET": lookup_updates}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)/attachments"), {"GET": list_attachments}),
    Route(re.compile(r"/tickets/(?P<ticket_id>[^/]+)/attachments/(?P<sha256>[0-9a-f]{64})"),
          {"PUT": put_attachment}, max_body=MAX_ATTACHMENT_BYTES),
    Route(re.compile(r"/ticket-batches"), {"POST": create_tickets_batch}),
    Route(re.compile(r"/fences"), {"POST": fence_key}),
    Route(re.compile(r"/_admin/effects"), {"GET": admin_effects}),
    Route(re.compile(r"/_admin/tickets"), {"GET": admin_tickets}),
    Route(re.compile(r"/_admin/faults"), {"POST": admin_faults}),
    Route(re.compile(r"/_admin/webhooks"), {"GET": admin_webhooks}),
    Route(re.compile(r"/_admin/reset"), {"POST": admin_reset}),
)


def find_route(path):
    """Return ``(route, params)`` for ``path``, or ``(None, {})`` when no route matches."""
    for route in ROUTES:
        match = route.pattern.fullmatch(path)
        if match:
            return route, match.groupdict()
    return None, {}
