"""Sessions as Django's database backend keeps them, the session row read by one statement
written once (``SESSION_ENGINE = "apps.accounts.sessions"``; docs/performance.md, "Prepared
statements").

Every signed-in request reads its session row first. Django's backend builds that read as a
queryset per request — a tenth of a report's submission CPU on the 2-core machines faultdesk is
measured on; :mod:`apps.core.sql` writes it once, and the server prepares it once per connection.
Everything else — the table, the row's shape, expiry, saving, rotating the key on sign-in,
flushing it on sign-out — is Django's own :class:`django.contrib.sessions.backends.db.SessionStore`,
so sessions written before and after the change are the same rows."""

from __future__ import annotations

from django.contrib.sessions.backends import db
from django.utils import timezone

from apps.core import sql


class SessionStore(db.SessionStore):
    """Django's database session store; :meth:`_get_session_from_db` reads the row with
    :func:`apps.core.sql.row` (the same condition: this key, not expired)."""

    def _get_session_from_db(self):
        """The unexpired session row of this store's key, or None (and the key forgotten, as
        Django's store does, so that the next save makes a new one)."""
        found = sql.row(self.model, "t0.session_key = %s AND t0.expire_date > %s",
                        [self.session_key, timezone.now()])
        if found is None:
            self._session_key = None
        return found
