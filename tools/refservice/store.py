"""SQLite storage for the reference ticket service.

One file database in WAL mode. Every call opens its own connection, so each
request thread has its own; writes run inside ``BEGIN IMMEDIATE`` transactions,
which take SQLite's write lock up front. That serialises concurrent creates for
the same ``Idempotency-Key``: the first one inserts the ticket, every later one
sees the stored key and replays. The storage survives restarts.

Tables:

* ``tickets`` -- one row per ticket; ``doc`` is the ticket JSON, ``seq`` gives
  the sequential id (``REF-000001``...).
* ``idempotency_keys`` -- per key: body digest, ticket id, the stored create
  response, the highest fencing token seen and the effects counter.
* ``webhooks`` -- status-change events to deliver (:mod:`.webhook_outbox`, :mod:`.webhooks`), written
  in the same transaction as the change when ``record_webhooks`` is on.
* ``attachments`` -- files attached to a ticket (:mod:`.attachments`).
* ``fences`` -- per key, the highest fencing token seen, whether it came with a
  create or with a fence alone (``POST /fences``). A fence may name a key no
  ticket has been created for yet: after it, a create with a lower token is
  refused, so "nothing found after the fence" means "nothing will ever be
  created by a lower token".
"""

import json
import os
import sqlite3
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from .attachments import ATTACHMENTS_SCHEMA, AttachmentStore
from .webhook_outbox import WEBHOOKS_SCHEMA, WebhookOutbox

SCHEMA_VERSION = 3
SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    idempotency_key TEXT NOT NULL UNIQUE,
    version INTEGER NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY,
    body_digest TEXT NOT NULL,
    ticket_id TEXT NOT NULL,
    response_status INTEGER NOT NULL,
    response_body TEXT NOT NULL,
    highest_fencing_token INTEGER,
    effects INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS fences (
    key TEXT PRIMARY KEY,
    highest_fencing_token INTEGER NOT NULL,
    updated_at TEXT NOT NULL,
    fenced_at TEXT
);
"""


class NotFound(Exception):
    """The ticket does not exist."""


class VersionMismatch(Exception):
    """``If-Match`` named a version other than ``current_version``."""

    def __init__(self, current_version):
        super().__init__(f"current version is {current_version}")
        self.current_version = current_version


class StaleFencingToken(Exception):
    """The request's fencing token is below ``highest``, the maximum seen for its key."""

    def __init__(self, highest):
        super().__init__(f"highest fencing token seen is {highest}")
        self.highest = highest


class FencingTokenRequired(Exception):
    """The key was fenced (``POST /fences``): a create without a fencing token is refused."""


class IdempotencyKeyReused(Exception):
    """The idempotency key was first used with a different request body."""


@dataclass(frozen=True)
class FenceResult:
    """Outcome of :meth:`TicketStore.fence`: the key's highest token after the fence and the
    ticket created with the key, or None when there is none (and now never will be by a lower
    token)."""

    highest_fencing_token: int
    ticket: dict | None
    comment: dict | None = None
    update: dict | None = None


@dataclass(frozen=True)
class CreateResult:
    """Outcome of :meth:`TicketStore.create_ticket`.

    ``status`` and ``body`` are the response to send; ``replayed`` is True when
    they are the stored response of an earlier request with the same key.
    """

    status: int
    body: dict
    replayed: bool


def utc_now():
    """Return the current UTC time as ISO 8601 with milliseconds, e.g. ``2025-01-02T03:04:05.678Z``."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def format_ticket_id(seq):
    """Return the public id for sequence number ``seq``: 123 -> ``REF-000123``."""
    return f"REF-{seq:06d}"


class TicketStore(AttachmentStore, WebhookOutbox):
    """Tickets and idempotency records in one SQLite file at ``db_path``.

    Safe to share between threads: each method opens and closes its own
    connection. ``db_path`` must be a file path (not ``:memory:``); missing
    parent directories are created. Writers wait up to ``busy_timeout`` seconds
    for the write lock before ``sqlite3.OperationalError`` is raised.
    """

    def __init__(self, db_path, busy_timeout=30.0, record_webhooks=False):
        self.db_path = os.fspath(db_path)
        self.busy_timeout = busy_timeout
        self.record_webhooks = record_webhooks
        parent = os.path.dirname(os.path.abspath(self.db_path))
        os.makedirs(parent, exist_ok=True)
        with closing(self._connect()) as conn:
            (found,) = conn.execute("PRAGMA user_version").fetchone()
            if found > SCHEMA_VERSION:
                raise RuntimeError(f"{self.db_path} has storage schema {found}, newer than this code's "
                                   f"{SCHEMA_VERSION}: refusing to open it (older code would ignore fences)")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA + WEBHOOKS_SCHEMA + ATTACHMENTS_SCHEMA)
            # Schema 2 had no fenced_at column.
            columns = {row[1] for row in conn.execute("PRAGMA table_info(fences)")}
            if "fenced_at" not in columns:
                conn.execute("ALTER TABLE fences ADD COLUMN fenced_at TEXT")
            # Schema 1 kept the highest token only in idempotency_keys: carry it into fences.
            conn.execute(
                "INSERT OR IGNORE INTO fences (key, highest_fencing_token, updated_at)"
                " SELECT key, highest_fencing_token, created_at FROM idempotency_keys"
                " WHERE highest_fencing_token IS NOT NULL"
            )
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _connect(self):
        # isolation_level=None: autocommit, so transactions are exactly the BEGIN/COMMIT we issue.
        return sqlite3.connect(self.db_path, timeout=self.busy_timeout, isolation_level=None)

    @contextmanager
    def _read(self):
        with closing(self._connect()) as conn:
            yield conn

    @contextmanager
    def _write(self):
        """Yield a connection inside ``BEGIN IMMEDIATE``; commit on success, roll back on error."""
        with closing(self._connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def create_ticket(self, key, digest, fields, fencing_token=None):
        """Create the ticket for idempotency ``key`` once; replay it afterwards.

        ``fields`` are validated ticket fields, ``digest`` the request body
        digest, ``fencing_token`` an int or None (not fenced). Returns a
        :class:`CreateResult`: 201 with the new ticket, or the stored response
        with ``replayed=True`` when ``key`` was already used with ``digest``.
        An accepted token above the stored maximum raises it.

        Raises :class:`StaleFencingToken` when ``fencing_token`` is below the
        maximum seen for ``key``, :class:`FencingTokenRequired` when ``key`` was
        fenced and no token is given, and :class:`IdempotencyKeyReused` when
        ``key`` was used with another digest; none changes anything.
        """
        with self._write() as conn:
            row = conn.execute(
                "SELECT body_digest, response_status, response_body, highest_fencing_token"
                " FROM idempotency_keys WHERE key = ?",
                (key,),
            ).fetchone()
            highest = self._highest_token(conn, key)
            if fencing_token is not None and highest is not None and fencing_token < highest:
                raise StaleFencingToken(highest)
            if fencing_token is None and self._is_fenced(conn, key):
                raise FencingTokenRequired()
            if row is not None:
                stored_digest, status, body, _ = row
                if stored_digest != digest:
                    raise IdempotencyKeyReused()
                if fencing_token is not None and (highest is None or fencing_token > highest):
                    self._raise_token(conn, key, fencing_token)
                return CreateResult(status, json.loads(body), replayed=True)

            now = utc_now()
            (seq,) = conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM tickets").fetchone()
            ticket = {
                "id": format_ticket_id(seq),
                "version": 1,
                "status": "open",
                **fields,
                "assignee": None,
                "comments": [],
                "idempotency_key": key,
                "created_at": now,
                "updated_at": now,
            }
            doc = json.dumps(ticket, ensure_ascii=False)
            conn.execute(
                "INSERT INTO tickets (seq, id, idempotency_key, version, doc) VALUES (?, ?, ?, 1, ?)",
                (seq, ticket["id"], key, doc),
            )
            conn.execute(
                "INSERT INTO idempotency_keys (key, body_digest, ticket_id, response_status, response_body,"
                " highest_fencing_token, effects, created_at) VALUES (?, ?, ?, 201, ?, ?, 1, ?)",
                (key, digest, ticket["id"], doc, fencing_token, now),
            )
            if fencing_token is not None and (highest is None or fencing_token > highest):
                self._raise_token(conn, key, fencing_token)
            return CreateResult(201, ticket, replayed=False)

    @staticmethod
    def _highest_token(conn, key):
        row = conn.execute("SELECT highest_fencing_token FROM fences WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    @staticmethod
    def _is_fenced(conn, key):
        row = conn.execute("SELECT fenced_at FROM fences WHERE key = ?", (key,)).fetchone()
        return bool(row and row[0])

    @staticmethod
    def _raise_token(conn, key, token):
        conn.execute(
            "INSERT INTO fences (key, highest_fencing_token, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT(key) DO UPDATE SET highest_fencing_token = excluded.highest_fencing_token,"
            " updated_at = excluded.updated_at WHERE excluded.highest_fencing_token > fences.highest_fencing_token",
            (key, token, utc_now()),
        )
        conn.execute("UPDATE idempotency_keys SET highest_fencing_token = ? WHERE key = ?", (token, key))

    def fence(self, key, fencing_token):
        """Raise the highest fencing token of idempotency ``key`` to ``fencing_token`` (an int),
        whether or not a ticket exists for it, and return a :class:`FenceResult` with the ticket
        created with ``key`` (or None).

        One write transaction: every create for ``key`` either committed before it (and its ticket
        is returned) or comes after it and is refused when its token is lower. A token equal to the
        stored maximum is accepted (fencing again is harmless). Raises :class:`StaleFencingToken`
        when ``fencing_token`` is below the maximum (the caller is itself stale); nothing changes.
        """
        with self._write() as conn:
            highest = self._highest_token(conn, key)
            if highest is not None and fencing_token < highest:
                raise StaleFencingToken(highest)
            if highest is None or fencing_token > highest:
                self._raise_token(conn, key, fencing_token)
            conn.execute("UPDATE fences SET fenced_at = ? WHERE key = ?", (utc_now(), key))
            row = conn.execute("SELECT doc FROM tickets WHERE idempotency_key = ?", (key,)).fetchone()
            comment = update = None
            if row is None:  # a comment's (201) or an update's (200) key: its stored response
                found = conn.execute("SELECT response_status, response_body FROM idempotency_keys WHERE key = ?",
                                     (key,)).fetchone()
                if found is not None:
                    if found[0] == 201:
                        comment = json.loads(found[1])
                    else:
                        update = json.loads(found[1])
        return FenceResult(max(fencing_token, highest or 0), json.loads(row[0]) if row else None, comment, update)

    def add_comment(self, ticket_id, key, digest, body, expected_version=None, fencing_token=None):
        """Append a comment to a ticket once per idempotency ``key``; replay it afterwards.

        ``body`` is the validated comment text, ``digest`` the request body digest,
        ``expected_version`` the ``If-Match`` version or None (unconditional),
        ``fencing_token`` an int or None. A new comment bumps the ticket's version. Returns a
        :class:`CreateResult` whose body is ``{"comment": {"id", "body", "created_at",
        "idempotency_key"}, "ticket_id", "ticket_version"}``.

        Raises :class:`StaleFencingToken`, :class:`FencingTokenRequired`,
        :class:`IdempotencyKeyReused` (the key was used with another body or ticket),
        :class:`NotFound` and :class:`VersionMismatch`; none changes anything.
        """
        with self._write() as conn:
            highest = self._highest_token(conn, key)
            if fencing_token is not None and highest is not None and fencing_token < highest:
                raise StaleFencingToken(highest)
            if fencing_token is None and self._is_fenced(conn, key):
                raise FencingTokenRequired()
            row = conn.execute("SELECT body_digest, ticket_id, response_body FROM idempotency_keys WHERE key = ?",
                               (key,)).fetchone()
            if row is not None:
                stored_digest, stored_ticket, response = row
                if stored_digest != digest or stored_ticket != ticket_id:
                    raise IdempotencyKeyReused()
                if fencing_token is not None and (highest is None or fencing_token > highest):
                    self._raise_token(conn, key, fencing_token)
                return CreateResult(201, json.loads(response), replayed=True)
            found = conn.execute("SELECT version, doc FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
            if found is None:
                raise NotFound(ticket_id)
            version, doc = found
            if expected_version is not None and version != expected_version:
                raise VersionMismatch(version)
            ticket = json.loads(doc)
            now = utc_now()
            comment = {"id": f"{ticket_id}-C{len(ticket['comments']) + 1}", "body": body, "created_at": now,
                       "idempotency_key": key}
            ticket["comments"].append(comment)
            ticket["version"] = version + 1
            ticket["updated_at"] = now
            conn.execute("UPDATE tickets SET version = ?, doc = ? WHERE id = ?",
                         (ticket["version"], json.dumps(ticket, ensure_ascii=False), ticket_id))
            response = {"comment": comment, "ticket_id": ticket_id, "ticket_version": ticket["version"]}
            conn.execute(
                "INSERT INTO idempotency_keys (key, body_digest, ticket_id, response_status, response_body,"
                " highest_fencing_token, effects, created_at) VALUES (?, ?, ?, 201, ?, ?, 1, ?)",
                (key, digest, ticket_id, json.dumps(response, ensure_ascii=False), fencing_token, now),
            )
            if fencing_token is not None and (highest is None or fencing_token > highest):
                self._raise_token(conn, key, fencing_token)
            return CreateResult(201, response, replayed=False)

    def find_comment_by_key(self, ticket_id, key):
        """Return the stored comment response for idempotency ``key`` on ``ticket_id``, or None."""
        return self._find_write_by_key(ticket_id, key, 201)

    def find_update_by_key(self, ticket_id, key):
        """Return the stored update response (the ticket as that update left it) for idempotency
        ``key`` on ``ticket_id``, or None."""
        return self._find_write_by_key(ticket_id, key, 200)

    def _find_write_by_key(self, ticket_id, key, status):
        with self._read() as conn:
            row = conn.execute("SELECT response_body FROM idempotency_keys WHERE key = ? AND ticket_id = ?"
                               " AND response_status = ?"
                               " AND NOT EXISTS (SELECT 1 FROM tickets WHERE idempotency_key = ?)",
                               (key, ticket_id, status, key)).fetchone()
        return json.loads(row[0]) if row else None

    def update_ticket(self, ticket_id, expected_version, changes, key=None, digest=None, fencing_token=None):
        """Apply validated ``changes`` to a ticket if it is at ``expected_version``.

        ``changes`` may hold ``status``, ``priority``, ``assignee`` and
        ``comment`` (appended to ``comments`` as ``{"body", "created_at"}``).
        With an idempotency ``key`` (and the body ``digest``), the update happens once per key:
        the same key again returns the stored ticket (``replayed``) whatever the ticket's version
        is now; the key with another body or ticket raises :class:`IdempotencyKeyReused`;
        ``fencing_token`` is checked as for comments. Returns a :class:`CreateResult` whose body
        is the ticket at version + 1. Raises :class:`NotFound`, :class:`VersionMismatch`,
        :class:`StaleFencingToken`, :class:`FencingTokenRequired` or
        :class:`IdempotencyKeyReused`; none changes anything.
        """
        with self._write() as conn:
            highest = self._highest_token(conn, key) if key else None
            if key is not None:
                if fencing_token is not None and highest is not None and fencing_token < highest:
                    raise StaleFencingToken(highest)
                if fencing_token is None and self._is_fenced(conn, key):
                    raise FencingTokenRequired()
                stored = conn.execute("SELECT body_digest, ticket_id, response_body FROM idempotency_keys"
                                      " WHERE key = ?", (key,)).fetchone()
                if stored is not None:
                    if stored[0] != digest or stored[1] != ticket_id:
                        raise IdempotencyKeyReused()
                    if fencing_token is not None and (highest is None or fencing_token > highest):
                        self._raise_token(conn, key, fencing_token)
                    return CreateResult(200, json.loads(stored[2]), replayed=True)
            row = conn.execute("SELECT version, doc FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
            if row is None:
                raise NotFound(ticket_id)
            version, doc = row
            if version != expected_version:
                raise VersionMismatch(version)
            ticket = json.loads(doc)
            now = utc_now()
            previous_status = ticket["status"]
            for name in ("status", "priority", "assignee"):
                if name in changes:
                    ticket[name] = changes[name]
            if "comment" in changes:
                ticket["comments"].append({"body": changes["comment"], "created_at": now})
            ticket["version"] = version + 1
            ticket["updated_at"] = now
            conn.execute(
                "UPDATE tickets SET version = ?, doc = ? WHERE id = ?",
                (ticket["version"], json.dumps(ticket, ensure_ascii=False), ticket_id),
            )
            if self.record_webhooks and ticket["status"] != previous_status:
                self._webhook_add(conn, {
                    "type": "ticket.status_changed", "ticket_id": ticket_id,
                    "idempotency_key": ticket["idempotency_key"], "version": ticket["version"],
                    "status": ticket["status"], "previous_status": previous_status, "occurred_at": now,
                })
            if key is not None:
                conn.execute(
                    "INSERT INTO idempotency_keys (key, body_digest, ticket_id, response_status, response_body,"
                    " highest_fencing_token, effects, created_at) VALUES (?, ?, ?, 200, ?, ?, 1, ?)",
                    (key, digest, ticket_id, json.dumps(ticket, ensure_ascii=False), fencing_token, now),
                )
                if fencing_token is not None and (highest is None or fencing_token > highest):
                    self._raise_token(conn, key, fencing_token)
            return CreateResult(200, ticket, replayed=False)

    def get_ticket(self, ticket_id):
        """Return the ticket dict with id ``ticket_id``, or None."""
        with self._read() as conn:
            row = conn.execute("SELECT doc FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def find_by_idempotency_key(self, key):
        """Return the ticket created with idempotency ``key``, or None."""
        with self._read() as conn:
            row = conn.execute("SELECT doc FROM tickets WHERE idempotency_key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def list_tickets(self):
        """Return every ticket dict, oldest first."""
        with self._read() as conn:
            rows = conn.execute("SELECT doc FROM tickets ORDER BY seq").fetchall()
        return [json.loads(doc) for (doc,) in rows]

    def effects(self, key):
        """Return how many tickets were really created for idempotency ``key`` (0 or 1)."""
        with self._read() as conn:
            row = conn.execute("SELECT effects FROM idempotency_keys WHERE key = ?", (key,)).fetchone()
        return row[0] if row else 0

    def reset(self):
        """Delete every ticket and idempotency record; ids restart at ``REF-000001``."""
        with self._write() as conn:
            conn.execute("DELETE FROM attachments")
            conn.execute("DELETE FROM tickets")
            conn.execute("DELETE FROM idempotency_keys")
            conn.execute("DELETE FROM fences")
            conn.execute("DELETE FROM webhooks")
