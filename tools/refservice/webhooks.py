"""Signed outbound webhooks of the reference ticket service (DESIGN.md §11).

When a ticket's status changes, the service stores a webhook event in its SQLite file (same
transaction as the change, so none is lost to a crash) and a background thread delivers it:
``POST <url>`` with the JSON body and two headers:

* ``X-Refservice-Event-Id: <event_id>`` — unique per event; a redelivery carries the same id;
* ``X-Refservice-Signature: t=<unix seconds>,v1=<hex>``, made by
  :func:`apps.tickets.webhook_signature.sign` (the product verifies it with the same module).

Body: ``{"event_id", "type": "ticket.status_changed", "ticket_id", "idempotency_key",
"version", "status", "previous_status", "occurred_at"}``.

Undelivered events (connection error or a non-2xx answer) are retried with exponential backoff
(1 s, 2 s, 4 s, ... capped at 60 s) for up to ``max_attempts`` deliveries.
"""

import json
import logging
import threading
import urllib.error
import urllib.request

from apps.tickets.webhook_signature import sign

log = logging.getLogger(__name__)


class WebhookSender:
    """Delivers the store's pending webhook events to ``url``, signed with ``secret``, from one
    daemon thread. :meth:`wake` after storing an event; :meth:`stop` ends the thread."""

    def __init__(self, store, url, secret, *, max_attempts=8, timeout=5.0):
        self.store = store
        self.url = url
        self.secret = secret
        self.max_attempts = max_attempts
        self.timeout = timeout
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="refservice-webhooks", daemon=True)
        self._thread.start()

    def wake(self):
        """Deliver now instead of at the next poll."""
        self._wake.set()

    def stop(self):
        """Stop the delivery thread (pending events stay stored for the next start)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(5)

    def _run(self):
        while not self._stopped.is_set():
            try:
                self.deliver_due()
            except Exception:  # noqa: BLE001 - the thread must survive a bad row; logged
                log.exception("webhook delivery loop failed")
            self._wake.wait(0.5)
            self._wake.clear()

    def deliver_due(self):
        """Try every due event once. Returns how many were delivered."""
        delivered = 0
        for event_id, body, attempts in self.store.webhooks_due(self.max_attempts):
            raw = body.encode()
            request = urllib.request.Request(  # noqa: S310 - the URL is the operator's configuration
                self.url, data=raw, method="POST",
                headers={"Content-Type": "application/json", "X-Refservice-Event-Id": event_id,
                         "X-Refservice-Signature": sign(self.secret, raw)},
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                    ok = 200 <= response.status < 300
                    status = response.status
            except urllib.error.HTTPError as exc:
                ok, status = False, exc.code
            except (urllib.error.URLError, OSError) as exc:
                ok, status = False, repr(exc)
            if ok:
                self.store.webhook_delivered(event_id)
                delivered += 1
            else:
                delay = min(60.0, 2.0 ** attempts)
                self.store.webhook_failed(event_id, str(status), delay)
                log.warning("webhook %s not delivered (%s); retry in %.0f s", event_id, status, delay)
        return delivered


def event_body(event):
    """Serialise a webhook event dict to the exact bytes that are signed and sent."""
    return json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
