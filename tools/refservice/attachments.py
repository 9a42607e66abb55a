"""The reference ticket service's attachments: files attached to a ticket, one per (ticket, SHA-256
of the bytes), in the ``attachments`` table of :class:`~tools.refservice.store.TicketStore`'s
SQLite file (its ``_read``/``_write`` connections)."""

#: the table, created with the store's own (``CREATE TABLE IF NOT EXISTS``: an older file gains it)
ATTACHMENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS attachments (
    ticket_id TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    filename TEXT NOT NULL,
    content_type TEXT NOT NULL,
    size INTEGER NOT NULL,
    data BLOB NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (ticket_id, sha256)
);
"""


def _attachment_record(row):
    ticket_id, sha256, filename, content_type, size, created_at = row
    return {"ticket_id": ticket_id, "sha256": sha256, "filename": filename, "content_type": content_type,
            "size": size, "created_at": created_at}


class AttachmentStore:
    """The attachment methods of :class:`~tools.refservice.store.TicketStore`."""

    def add_attachment(self, ticket_id, sha256, filename, content_type, data):
        """Attach ``data`` (whose SHA-256 is ``sha256``) to ticket ``ticket_id``, once per digest.
        Returns ``(record, created)``: the stored record (without the bytes) and whether this call
        stored it. Raises :class:`NotFound` for no such ticket."""
        from .store import NotFound, utc_now

        with self._write() as conn:
            if conn.execute("SELECT 1 FROM tickets WHERE id = ?", (ticket_id,)).fetchone() is None:
                raise NotFound(ticket_id)
            cur = conn.execute(
                "INSERT OR IGNORE INTO attachments (ticket_id, sha256, filename, content_type, size, data, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (ticket_id, sha256, filename, content_type, len(data), data, utc_now()))
            created = cur.rowcount == 1
            row = conn.execute("SELECT ticket_id, sha256, filename, content_type, size, created_at FROM attachments"
                               " WHERE ticket_id = ? AND sha256 = ?", (ticket_id, sha256)).fetchone()
        return _attachment_record(row), created

    def list_attachments(self, ticket_id):
        """The records of ticket ``ticket_id``'s attachments, oldest first (no bytes). Raises
        :class:`NotFound` for no such ticket."""
        from .store import NotFound

        with self._read() as conn:
            if conn.execute("SELECT 1 FROM tickets WHERE id = ?", (ticket_id,)).fetchone() is None:
                raise NotFound(ticket_id)
            rows = conn.execute("SELECT ticket_id, sha256, filename, content_type, size, created_at FROM attachments"
                                " WHERE ticket_id = ? ORDER BY created_at, rowid", (ticket_id,)).fetchall()
        return [_attachment_record(r) for r in rows]

    def attachment_bytes(self, ticket_id, sha256):
        """The stored bytes of ticket ``ticket_id``'s attachment ``sha256``, or None."""
        with self._read() as conn:
            row = conn.execute("SELECT data FROM attachments WHERE ticket_id = ? AND sha256 = ?",
                               (ticket_id, sha256)).fetchone()
        return bytes(row[0]) if row else None
