"""SMTP through the tool gateway (ADR 0022): Django's SMTP e-mail backend with the relay's
destination checked before any socket is opened, its login injected by the gateway, a deadline on
each whole conversation step, a cap on the bytes of the server's replies, and every connect and every
send recorded (tool ``notifications.smtp``).

``EMAIL_BACKEND`` names :class:`GatewayEmailBackend` whenever ``EMAIL_HOST`` is set
(``config/settings/base.py``), and :func:`email_connection` hands it out in place of Django's own SMTP
backend, so no e-mail leaves by another way. The file, console and in-memory backends make no call and
are handed out as they are.
"""

from __future__ import annotations

import base64
import functools
import smtplib
import socket
import threading
import time

from django.conf import settings
from django.core.mail import get_connection
from django.core.mail.backends import smtp as django_smtp
from django.utils import timezone

from apps.gateway import credentials, resolver, tools
from apps.gateway.destinations import DEFAULT_PORTS, Destination
from apps.gateway.errors import DestinationRefused
from apps.gateway.records import call_record
from apps.gateway.redaction import scrub

#: the backends that talk SMTP; :func:`email_connection` hands out the gateway's in their place
SMTP_BACKENDS = ("django.core.mail.backends.smtp.EmailBackend", "apps.gateway.smtp.GatewayEmailBackend")


class ReplyTooLarge(Exception):  # noqa: N818 - the name says what happened
    """The server's reply was longer than the cap (``GATEWAY_SMTP_MAX_REPLY_BYTES``): not read further.
    Not an ``OSError`` (as smtplib's own errors are), so that smtplib does not turn it into "server
    disconnected" on its way out."""


class _CappedReader:
    """The reply stream of an SMTP connection, refusing to read past ``remaining`` bytes of one reply."""

    def __init__(self, raw, owner: GatewayEmailBackend):
        self._raw, self._owner, self.remaining = raw, owner, 0

    def readline(self, limit: int = -1) -> bytes:
        line = self._raw.readline(limit)
        self.remaining -= len(line)
        self._owner._bytes += len(line)
        if self.remaining < 0:
            raise ReplyTooLarge(f"the SMTP reply is longer than {self._owner._cap} bytes; not read further")
        return line

    def close(self) -> None:
        self._raw.close()


class _GuardedSMTPMixin:
    """smtplib's client, opening its socket only to the destination its backend allows, and reading
    each reply through a :class:`_CappedReader`."""

    def __init__(self, gateway: GatewayEmailBackend, *args, **kwargs):
        self._gateway = gateway
        super().__init__(*args, **kwargs)

    def _get_socket(self, host, port, timeout):
        self._gateway._at_socket(host, port)
        # the connect (and, for SMTPS, the whole TLS handshake: CPython bounds it by the socket's
        # timeout) runs before the deadline's shutdown knows the socket: bound it by the time left
        try:  # the name lookup too is bounded by the step's deadline
            found = resolver.addresses(str(host), port, self._gateway._time_left(timeout))
        except resolver.LookupTimedOut:
            self._gateway._expired = True
            raise
        failure: OSError | None = None
        for address in found:
            try:
                sock = super()._get_socket(address, port, self._gateway._time_left(timeout))
            except OSError as exc:
                failure = exc
                continue
            sock.settimeout(timeout)
            self._gateway._smtp = self
            return sock
        raise failure

    def getreply(self):
        if self.file is None and self.sock is not None:
            self.file = _CappedReader(self.sock.makefile("rb"), self._gateway)
        if isinstance(self.file, _CappedReader):
            self.file.remaining = self._gateway._cap
        return super().getreply()


class _GuardedSMTP(_GuardedSMTPMixin, smtplib.SMTP):
    pass


class _GuardedSMTPSSL(_GuardedSMTPMixin, smtplib.SMTP_SSL):
    pass


def _scrubbed(exc: BaseException, user: str, password: str) -> None:
    """Remove the relay's password from ``exc`` in place (a relay's reply may quote the login it was
    sent, as text or as the base64 of ``AUTH PLAIN``/``LOGIN``): its reply text, its recipients'
    replies, its arguments. What the sender records and logs is built from these."""
    if not password:
        return
    spellings = [password, base64.b64encode(password.encode()).decode(),
                 base64.b64encode(f"\0{user}\0{password}".encode()).decode()]

    def clean(value):
        if isinstance(value, bytes):
            text = value.decode("utf-8", "replace")
            cleaned = clean(text)
            return value if cleaned == text else cleaned.encode()
        if isinstance(value, str):
            for spelling in spellings:
                value = scrub(value, spelling)
        return value

    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        exc.recipients = {rcpt: (code, clean(msg)) for rcpt, (code, msg) in exc.recipients.items()}
    if isinstance(exc, smtplib.SMTPResponseException):
        exc.smtp_error = clean(exc.smtp_error)
    exc.args = tuple(clean(a) for a in exc.args)


def _outcome_of(exc: BaseException, *, expired: bool, connected: bool) -> str:
    """The recorded outcome class of an SMTP failure."""
    if isinstance(exc, DestinationRefused):
        return "refused_destination"
    if isinstance(exc, ReplyTooLarge):
        return "too_large"
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _msg in exc.recipients.values()]
        return "smtp_5xx" if codes and all(c >= 500 for c in codes) else "smtp_4xx"
    if isinstance(exc, smtplib.SMTPResponseException):
        return "smtp_5xx" if exc.smtp_code >= 500 else "smtp_4xx"
    if expired or isinstance(exc, TimeoutError | socket.timeout) and connected:
        return "timeout"
    if not connected:
        return "connect_error"
    return "transport_error"


class GatewayEmailBackend(django_smtp.EmailBackend):
    """Django's SMTP backend through the gateway (see the module). ``host`` and ``port`` default to
    ``EMAIL_HOST`` and ``EMAIL_PORT`` and must be a destination of ``notifications.smtp``; a
    ``username``/``password`` passed in is ignored — the login is always the gateway's
    (:func:`apps.gateway.credentials.smtp_login`) — and so, when there is a password, are ``use_tls`` and
    ``use_ssl`` (the settings' ``EMAIL_USE_TLS``/``EMAIL_USE_SSL`` hold). Each ``open()`` and each
    ``send_messages()`` is bounded by ``GATEWAY_SMTP_DEADLINE_SECONDS`` as a whole (the connection is shut down when it
    passes) and recorded. Raises what Django's backend raises, and :class:`DestinationRefused`."""

    def __init__(self, host=None, port=None, username=None, password=None, use_tls=None, fail_silently=False,
                 use_ssl=None, timeout=None, ssl_keyfile=None, ssl_certfile=None, **kwargs):
        user, secret = credentials.smtp_login()
        if secret:  # the login travels only as the settings have it protected: a caller cannot turn TLS off
            use_tls, use_ssl = None, None
        super().__init__(host=host, port=port, username=user, password=secret, use_tls=use_tls,
                         fail_silently=fail_silently, use_ssl=use_ssl, timeout=timeout, ssl_keyfile=ssl_keyfile,
                         ssl_certfile=ssl_certfile, **kwargs)
        scheme = "smtps" if self.use_ssl else "smtp"
        self._destination = Destination(scheme, str(self.host).lower().strip("[]"),
                                        int(self.port or DEFAULT_PORTS[scheme]))
        self._cap = tools.caps(tools.SMTP).max_bytes
        self._deadline_seconds = float(settings.FAULTDESK["GATEWAY_SMTP_DEADLINE_SECONDS"])
        self._smtp = None
        self._bytes = 0
        self._expired = False
        self._deadline_at = None

    @property
    def connection_class(self):
        return functools.partial(_GuardedSMTPSSL if self.use_ssl else _GuardedSMTP, self)

    def _at_socket(self, host, port) -> None:
        """The second check, where the socket is opened."""
        if (str(host).lower().strip("[]"), int(port)) != (self._destination.host, self._destination.port):
            raise DestinationRefused(tools.SMTP, f"the connection to {host}:{port} was refused at the socket")

    def _time_left(self, timeout: float | None) -> float | None:
        """``timeout`` shortened to the time left in the current step; raises ``TimeoutError`` when
        none is left."""
        if self._deadline_at is None:
            return timeout
        left = self._deadline_at - time.monotonic()
        if left <= 0:
            self._expired = True
            raise TimeoutError("the SMTP step's deadline passed")
        return left if timeout is None else min(timeout, left)

    def _expire(self) -> None:
        self._expired = True
        sock = getattr(self._smtp, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the blocked read or write returns: the conversation ends
            except OSError:
                pass

    def _step(self, method: str, fn):
        """Run ``fn`` (an open or a send) under the deadline, and record it as ``method``. A step run
        inside another (the open a send makes) keeps the outer step's deadline."""
        at, started = timezone.now(), time.monotonic()
        nested = self._deadline_at is not None
        if not nested:
            self._bytes, self._expired = 0, False
        connected_before = self.connection is not None

        def record(outcome: str) -> None:
            call_record(tool=tools.SMTP, destination=self._destination, method=method, path="", outcome=outcome,
                        at=at, duration_ms=int((time.monotonic() - started) * 1000), bytes_received=self._bytes)

        try:
            allowed = self._destination in tools.allowed_destinations(tools.SMTP)
        except ValueError:  # a listed destination that cannot be read: nothing is reachable until it is fixed
            allowed = False
        if not allowed:
            record("refused_destination")
            raise DestinationRefused(tools.SMTP, f"{self._destination} is not a destination notifications.smtp "
                                                 "may reach")
        if nested:
            try:
                result = fn()
            except BaseException as exc:
                record(_outcome_of(exc, expired=self._expired, connected=self.connection is not None))
                raise
            record("ok")
            return result
        self._deadline_at = time.monotonic() + self._deadline_seconds
        timer = threading.Timer(self._deadline_seconds, self._expire)
        timer.daemon = True
        timer.start()
        try:
            result = fn()
        except BaseException as exc:
            connected = connected_before or getattr(self._smtp, "sock", None) is not None or self.connection is not None
            record(_outcome_of(exc, expired=self._expired, connected=connected))
            _scrubbed(exc, self.username or "", self.password or "")
            raise
        finally:
            timer.cancel()
            self._deadline_at = None
        record("ok")
        return result

    def open(self):
        if self.connection:
            return False
        self._smtp = None
        return self._step("CONNECT", super().open)

    def send_messages(self, email_messages):
        if not email_messages:
            return 0
        return self._step("SEND", functools.partial(super().send_messages, email_messages))


def email_connection(**kwargs):
    """The e-mail backend to send with: :class:`GatewayEmailBackend` when ``EMAIL_BACKEND`` talks SMTP
    (Django's SMTP backend, or the gateway's), otherwise the configured one (``kwargs`` as
    ``django.core.mail.get_connection`` takes them)."""
    if settings.EMAIL_BACKEND in SMTP_BACKENDS:
        return GatewayEmailBackend(**kwargs)
    return get_connection(**kwargs)
