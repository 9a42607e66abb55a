"""A stdlib HTTP client for the reference ticket service's tests: each call opens a fresh
``http.client`` connection to a server (``serve_in_thread`` on port 0, see ``conftest.py``)."""

import http.client
import json

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

TICKET = {
    "title": "Router R-12 drops uplink every hour",
    "description": "Uplink flaps; logs attached.",
    "priority": "P2",
    "device": "router-r12",
    "requester": "ana@example.com",
    "tenant": "acme",
    "labels": ["network"],
    "evidence": ["kb/public/uplink-flap.md"],
}


def call(server, method, path, body=None, headers=None, auth=True, raw=None):
    """Send one request on a new connection; return ``(status, headers, json_body)``."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        all_headers = {**(AUTH if auth else {}), **(headers or {})}
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            all_headers.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=data, headers=all_headers)
        response = conn.getresponse()
        payload = response.read()
        return response.status, response.headers, json.loads(payload) if payload else None
    finally:
        conn.close()


def create(server, key, body=TICKET, **headers):
    """POST /tickets with ``Idempotency-Key: key`` (plus extra headers given as keyword args)."""
    extra = {name.replace("_", "-"): value for name, value in headers.items()}
    return call(server, "POST", "/tickets", body, {"Idempotency-Key": key, **extra})


def effects(server, key):
    """Return the service's effects counter for ``key``."""
    status, _, body = call(server, "GET", f"/_admin/effects?idempotency_key={key}")
    assert status == 200
    return body["effects"]


def fence(server, key, token):
    """POST /fences for ``key`` at ``token``; return ``(status, json_body)``."""
    status, _, body = call(server, "POST", "/fences", None, {"Idempotency-Key": key, "X-Fencing-Token": str(token)})
    return status, body


def comment(server, ticket_id, key, body="Rebooted; still failing.", **headers):
    """POST /tickets/<id>/comments with ``Idempotency-Key: key`` (plus extra headers as keyword args)."""
    extra = {name.replace("_", "-"): value for name, value in headers.items()}
    return call(server, "POST", f"/tickets/{ticket_id}/comments", {"body": body}, {"Idempotency-Key": key, **extra})

