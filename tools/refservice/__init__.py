"""Reference ticket service: the external ticket system that ships with faultdesk.

It runs as its own process with its own SQLite storage (WAL mode) and uses the
Python standard library only (no Django). Start it with::

    python -m tools.refservice --host 127.0.0.1 --port 8765 \\
        --db var/refservice/tickets.sqlite3 --api-key KEY

``--api-key`` may instead come from the environment variable
``REFSERVICE_API_KEY`` (preferred: it stays out of the process list). With no
key configured, authentication is off. Tests use :func:`make_server` and
:func:`serve_in_thread`.

HTTP API
========

Every request and response body is JSON (``Content-Type: application/json``).
Every error body has the shape ``{"error": "<code>", ...}``; the service never
returns a traceback. Bodies larger than 1 MiB get 413 ``payload_too_large``.

Authentication
    When an API key is configured, every route except ``GET /healthz`` needs
    ``Authorization: Bearer <api-key>``; otherwise 401 ``{"error":"unauthorized"}``.

Ticket shape
    ``{"id": "REF-000123", "version": 1, "status": "open", "title", "description",
    "priority", "device", "requester", "tenant", "labels": [...], "evidence": [...],
    "assignee": null, "comments": [{"body", "created_at"}], "idempotency_key",
    "created_at", "updated_at"}``. Timestamps are UTC ISO 8601 (``...Z``).

``POST /tickets`` -- create a ticket, exactly once per idempotency key
    Headers: ``Idempotency-Key`` (required, 1..255 visible ASCII characters;
    missing -> 400 ``idempotency_key_required``), ``X-Fencing-Token`` (optional
    non-negative integer).
    Body: ``{"title": str (1..200), "description": str, "priority": "P1".."P4",
    "device": str, "requester": str, "tenant": str, "labels": [str],
    "evidence": [str]}``; title, priority, device and tenant are required,
    unknown fields are rejected. A bad body or bad JSON -> 400
    ``{"error":"invalid_params","detail":"..."}``.
    The body digest is SHA-256 over the canonical JSON of the body as sent
    (``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``).

    * New key: creates the ticket (sequential id, version 1, status ``open``),
      stores key, digest and response; 201 with the ticket, ``ETag: "1"`` and
      ``Location: /tickets/<id>``.
    * Same key, same digest: 201 with the stored response (the ticket as it was
      created) plus ``Idempotent-Replayed: true``; nothing new happens.
    * Same key, different digest: 422 ``{"error":"idempotency_key_reused","detail":"..."}``.
    * Same key while an earlier request with it is still being processed (e.g.
      during a ``delay`` fault): 409 ``{"error":"request_in_progress"}`` with
      ``Retry-After: 1``; nothing happens. A retry after it finished replays.
    * Fencing: the highest token seen per key is stored. A token lower than it
      gets 409 ``{"error":"stale_fencing_token","highest":N}``; an equal or
      higher token is accepted and raises the stored maximum. Requests without
      the header are not fenced. Rejected requests (409/422) change nothing.

``POST /ticket-batches`` -- several creates in one request (the outbox's bulk delivery)
    Body ``{"items": [{"idempotency_key": str, "fencing_token": int | null,
    "ticket": {the POST /tickets body}}, ...]}``: 1..100 items, no key twice,
    else 400 ``invalid_params`` and nothing happens. Each item is handled
    exactly as its own ``POST /tickets`` would be (its key, token, digest,
    store transaction, ``request_in_progress``, armed fault), so an item resent
    alone later replays. 200 ``{"results": [...]}`` in the order sent, each
    ``{"idempotency_key", "status": 201, "replayed": bool, "ticket": ticket}``
    or ``{"idempotency_key", "status": <what POST /tickets answers>, "error",
    ...}``. A ``drop_after_commit`` fault taken by any item: every item is
    processed, then the connection is closed without a response.

``POST /fences`` -- fence an idempotency key (reconciliation before "not executed")
    Headers: ``Idempotency-Key`` and ``X-Fencing-Token`` (both required). Raises
    the key's highest token to the one given, even when no ticket exists for the
    key yet, in the same transaction as it looks the key up. Answers 200
    ``{"idempotency_key", "highest_fencing_token", "ticket": ticket | null,
    "comment": comment response | null}`` (``comment`` for a comment's key).
    After it, every ``POST /tickets`` for the key with a lower token gets 409,
    so ``"ticket": null`` means no request with a lower token can ever create
    one. A token below the stored maximum gets 409 ``stale_fencing_token`` and
    changes nothing; an equal token is accepted. Once a key is fenced, a
    ``POST /tickets`` for it without ``X-Fencing-Token`` gets 409
    ``fencing_token_required``.

``POST /tickets/<id>/comments`` -- a comment, exactly once per idempotency key
    Headers: ``Idempotency-Key`` (required; each comment has its own key),
    ``If-Match: "<version>"`` (optional: conditional on the ticket's version,
    else 412 ``version_mismatch``), ``X-Fencing-Token`` (as for creates).
    Body ``{"body": str}``. 201 ``{"comment": {"id", "body", "created_at",
    "idempotency_key"}, "ticket_id", "ticket_version"}``; the ticket's version
    goes up by one. The same key again replays the stored response
    (``Idempotent-Replayed: true``); with another body or ticket, 422
    ``idempotency_key_reused``. Unknown ticket: 404.
    ``GET /tickets/<id>/comments?idempotency_key=K`` -> ``{"results": [that
    response]}`` (0 or 1 entries).

``GET /tickets/<id>``
    200 ticket with ``ETag: "<version>"``; 404 ``{"error":"not_found"}``.

``GET /tickets?idempotency_key=<key>``
    200 ``{"results": [ticket]}`` with 0 or 1 entries (reconciliation lookup).
    Without the query parameter: 400 ``invalid_params``.

``PATCH /tickets/<id>``
    Header ``If-Match: "<version>"`` (required; missing -> 428
    ``{"error":"precondition_required"}``). Body: any of ``status``
    (open|in_progress|resolved|closed), ``priority`` (P1..P4), ``assignee``
    (str or null), ``comment`` (str, appended to ``comments``); at least one.
    Stale version -> 412 ``{"error":"version_mismatch","current_version":N}``.
    Success -> 200 with the ticket at version + 1 and the new ``ETag``.
    With ``Idempotency-Key`` (optional) the update happens once per key: the
    same key again replays the stored ticket (``Idempotent-Replayed: true``,
    even after the ticket moved on), with another body or ticket 422;
    ``X-Fencing-Token`` as for creates. ``GET /tickets/<id>/updates?idempotency_key=K``
    -> ``{"results": [the ticket as that update left it]}`` (0 or 1 entries).

``GET /healthz``
    200 ``{"ok": true}``; never needs authentication.

Webhooks
    Started with ``--webhook-url`` (or ``REFSERVICE_WEBHOOK_URL``) and
    ``REFSERVICE_WEBHOOK_SECRET``, the service stores an event for every status
    change in the same transaction and delivers it as a signed ``POST`` (HMAC-SHA256,
    header ``X-Refservice-Signature: t=<unix>,v1=<hex>`` over ``"<t>." + body``, plus
    ``X-Refservice-Event-Id``), retrying with backoff; see :mod:`.webhooks`.

Admin / fault injection (same authentication; for tests)
    * ``GET /_admin/effects?idempotency_key=K`` -> ``{"idempotency_key": K, "effects": N,
      "requests": M}``: the number of real ticket creations for K (0 or 1), and of
      ``POST /tickets`` requests with K since the process started.
    * ``GET /_admin/tickets`` -> ``{"results": [every ticket, oldest first]}``.
    * ``GET /_admin/webhooks`` -> ``{"results": [every webhook event with its
      delivery state: attempts, delivered_at, last_status]}``.
    * ``POST /_admin/faults`` body ``{"mode": "none"|"drop_after_commit"|"fail_503"|"delay",
      "count": int >= 1 (default 1), "delay_seconds": float 0..60 (default 1.0)}``
      arms a fault for the next ``count`` valid keyed writes (``POST /tickets``,
      ``POST /tickets/<id>/comments``, ``PATCH`` with an ``Idempotency-Key``;
      requests rejected with 400 do not use it up, and the same 409 applies
      to all of them while their key is in flight):
      ``drop_after_commit`` commits, then closes the connection without a
      response (a lost response); ``fail_503`` answers 503
      ``{"error":"temporarily_unavailable"}`` with ``Retry-After: 1`` and does
      nothing; ``delay`` sleeps before processing; ``none`` disarms.
      Responds 200 with the armed state.
    * ``POST /_admin/reset`` wipes every ticket, key and fault, and restarts the
      id sequence at ``REF-000001``. Responds 200 ``{"ok": true}``.

Other errors
    Unknown route 404 ``{"error":"not_found"}``; wrong method 405
    ``{"error":"method_not_allowed","allowed":[...]}`` with ``Allow``; any
    unexpected failure 500 ``{"error":"internal"}`` (logged with its traceback).
"""

from .server import RefServiceServer, make_server, serve_in_thread

__all__ = ["RefServiceServer", "make_server", "serve_in_thread"]
