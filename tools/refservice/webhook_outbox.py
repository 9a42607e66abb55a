"""The reference ticket service's webhook outbox: status-change events written in the same
transaction as the change (``record_webhooks``), delivered by :class:`~tools.refservice.webhooks.WebhookSender`,
in the ``webhooks`` table of :class:`~tools.refservice.store.TicketStore`'s SQLite file (its
``_read``/``_write`` connections)."""

import json
import time
import uuid

from .webhooks import event_body

#: the table, created with the store's own (``CREATE TABLE IF NOT EXISTS``)
WEBHOOKS_SCHEMA = """
CREATE TABLE IF NOT EXISTS webhooks (
    event_id TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    delivered_at TEXT,
    last_status TEXT,
    created_at TEXT NOT NULL
);
"""


class WebhookOutbox:
    """The webhook methods of :class:`~tools.refservice.store.TicketStore`."""

    @staticmethod
    def _webhook_add(conn, event):
        event = {"event_id": uuid.uuid4().hex, **event}
        conn.execute(
            "INSERT INTO webhooks (event_id, body, attempts, next_attempt_at, created_at) VALUES (?, ?, 0, ?, ?)",
            (event["event_id"], event_body(event), time.time(), _utc_now()),
        )

    def webhooks_due(self, max_attempts):
        """Return ``[(event_id, body, attempts)]`` of undelivered events due now, oldest first."""
        with self._read() as conn:
            return conn.execute(
                "SELECT event_id, body, attempts FROM webhooks WHERE delivered_at IS NULL AND attempts < ?"
                " AND next_attempt_at <= ? ORDER BY created_at", (max_attempts, time.time()),
            ).fetchall()

    def webhook_delivered(self, event_id):
        """Mark the event delivered."""
        with self._write() as conn:
            conn.execute("UPDATE webhooks SET delivered_at = ?, attempts = attempts + 1, last_status = '2xx'"
                         " WHERE event_id = ?", (_utc_now(), event_id))

    def webhook_failed(self, event_id, status, delay_seconds):
        """Count a failed delivery of the event and schedule the next in ``delay_seconds``."""
        with self._write() as conn:
            conn.execute("UPDATE webhooks SET attempts = attempts + 1, last_status = ?, next_attempt_at = ?"
                         " WHERE event_id = ?", (status, time.time() + delay_seconds, event_id))

    def list_webhooks(self):
        """Return every webhook event with its delivery state, oldest first."""
        with self._read() as conn:
            rows = conn.execute("SELECT event_id, body, attempts, delivered_at, last_status FROM webhooks"
                                " ORDER BY created_at").fetchall()
        return [{"event_id": e, "body": json.loads(b), "attempts": a, "delivered_at": d, "last_status": st}
                for e, b, a, d, st in rows]


def _utc_now():
    from .store import utc_now

    return utc_now()
