"""SMTP through the tool gateway (ADR 0022): the relay's address is the only one a connection is made
to, the login is the gateway's (a real SMTP server on loopback, aiosmtpd, sees it; the sender never
holds it), a reply larger than the cap or slower than the deadline is cut and classed, and every
connect and send is recorded."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from email.message import EmailMessage

import pytest
from django.core.mail import EmailMessage as DjangoEmail

from apps.gateway.errors import DestinationRefused
from apps.gateway.models import GatewayCall
from apps.gateway.smtp import GatewayEmailBackend, email_connection
from apps.gateway.tests.servers import CountingListener, slow_name_lookup, smtp_relay_on_loopback, use_relay

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")]


class _Sink:
    def __init__(self):
        self.logins: list[tuple[str, str]] = []
        self.messages: list[bytes] = []

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        self.messages.append(envelope.original_content or envelope.content)
        return "250 OK"


@pytest.fixture
def smtp_relay(settings):
    """aiosmtpd on loopback requiring AUTH (over plain text, loopback only), configured as the relay."""
    from aiosmtpd.smtp import AuthResult

    sink = _Sink()

    def authenticator(server, session, envelope, mechanism, auth_data):
        sink.logins.append((auth_data.login.decode(), auth_data.password.decode()))
        return AuthResult(success=True)

    with smtp_relay_on_loopback(sink, authenticator) as port:
        use_relay(settings, port, "faultdesk-mailer", "smtp-pa55word-distinct",
                  backend="django.core.mail.backends.smtp.EmailBackend")
        yield sink, port


def _message(connection=None) -> DjangoEmail:
    return DjangoEmail(subject="hello", body="body", from_email="faultdesk@example.test", to=["a@example.test"],
                       connection=connection)


def test_the_relay_sees_the_login_the_sender_was_never_handed(smtp_relay, tmp_path, settings):
    sink, port = smtp_relay
    backend = email_connection(fail_silently=False)
    assert isinstance(backend, GatewayEmailBackend)
    assert backend.send_messages([_message(backend)]) == 1
    assert sink.logins == [("faultdesk-mailer", "smtp-pa55word-distinct")] and len(sink.messages) == 1
    # from a mounted secret file, and a password passed in by a caller is never used
    path = tmp_path / "smtp-password"
    path.write_text("from-the-file-pa55\n")
    settings.EMAIL_HOST_PASSWORD, settings.EMAIL_HOST_PASSWORD_FILE = "", str(path)
    backend = email_connection(fail_silently=False, password="a-caller-s-own")
    backend.send_messages([_message(backend)])
    assert sink.logins[-1] == ("faultdesk-mailer", "from-the-file-pa55")
    rows = list(GatewayCall.objects.filter(tool="notifications.smtp", port=port).order_by("at", "id"))
    assert [(r.method, r.outcome) for r in rows] == [("SEND", "ok"), ("CONNECT", "ok")] * 2 or \
        sorted((r.method, r.outcome) for r in rows) == [("CONNECT", "ok")] * 2 + [("SEND", "ok")] * 2
    assert all(r.scheme == "smtp" and r.host == "127.0.0.1" and r.bytes_received > 0 for r in rows)


def test_the_notification_sender_never_names_the_smtp_credential():
    import inspect

    from apps.notifications import sending

    source = inspect.getsource(sending)
    assert "EMAIL_HOST_PASSWORD" not in source and "EMAIL_HOST_USER" not in source


@pytest.mark.parametrize("host", ["127.0.0.1", "mail.elsewhere.invalid"])
def test_an_unlisted_relay_is_refused_before_any_connection_and_recorded(smtp_relay, host):
    sink, _port = smtp_relay
    listener = CountingListener()
    try:
        backend = GatewayEmailBackend(host=host, port=listener.port)
        with pytest.raises(DestinationRefused):
            backend.send_messages([_message(backend)])
        time.sleep(0.1)
        assert listener.accepts == 0 and sink.logins == []
    finally:
        listener.close()
    row = GatewayCall.objects.get(tool="notifications.smtp", host=host, port=listener.port)
    assert row.outcome == "refused_destination"


def _raw_smtp(script):
    """A raw TCP server running ``script(conn)`` for each connection; returns its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _run(script, c), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


def _run(script, conn):
    try:
        script(conn)
    except OSError:
        pass
    finally:
        conn.close()


@contextmanager
def _raw_relay(settings, answer, **faultdesk):
    """A raw SMTP server on loopback that talks by ``answer(conn)``, configured as the relay with the
    ``FAULTDESK`` settings ``faultdesk``; yields its port, closes it after."""
    server = _raw_smtp(answer)
    port = server.getsockname()[1]
    try:
        use_relay(settings, port)
        settings.FAULTDESK = {**settings.FAULTDESK, **faultdesk}
        yield port
    finally:
        server.close()


def test_a_reply_over_the_cap_is_cut_and_classed(settings):
    def flood(conn):
        for _ in range(1000):
            conn.sendall(b"220-" + b"x" * 1000 + b"\r\n")
        conn.sendall(b"220 ready\r\n")
        time.sleep(1)

    with _raw_relay(settings, flood, GATEWAY_SMTP_MAX_REPLY_BYTES=16384) as port:
        backend = email_connection(fail_silently=False)
        with pytest.raises(Exception) as caught:
            backend.open()
        assert "longer than 16384 bytes" in str(caught.value)
    row = GatewayCall.objects.get(tool="notifications.smtp", port=port)
    assert row.outcome == "too_large" and 16384 < row.bytes_received < 16384 + 2048


def test_a_trickling_reply_is_cut_at_the_deadline(settings):
    def trickle(conn):
        conn.sendall(b"220-")
        for _ in range(200):
            conn.sendall(b"x")
            time.sleep(0.05)

    with _raw_relay(settings, trickle, GATEWAY_SMTP_DEADLINE_SECONDS=0.5) as port:
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - smtplib's own error for the shut connection
            email_connection(fail_silently=False).open()
        assert time.monotonic() - started < 1.5
    assert GatewayCall.objects.get(tool="notifications.smtp", port=port).outcome == "timeout"


def test_a_temporary_refusal_is_classed_smtp_4xx(smtp_relay, settings):
    class Refusing(_Sink):
        async def handle_DATA(self, server, session, envelope):  # noqa: N802
            return "451 4.3.0 try again later"

    with smtp_relay_on_loopback(Refusing()) as port:
        use_relay(settings, port)
        backend = email_connection(fail_silently=False)
        with pytest.raises(Exception):  # noqa: B017 - smtplib.SMTPDataError
            backend.send_messages([_message(backend)])
    outcomes = sorted(GatewayCall.objects.filter(port=port).values_list("method", "outcome"))
    assert outcomes == [("CONNECT", "ok"), ("SEND", "smtp_4xx")]


def test_other_backends_make_no_call(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    backend = email_connection()
    assert not isinstance(backend, GatewayEmailBackend)
    assert EmailMessage  # the standard library's message type is not the gateway's concern


def test_an_smtp_reply_echoing_the_password_is_redacted(settings):
    """An SMTP relay's 535 may quote what it was sent; the sender stores the reply (Notification.error,
    a log line): the gateway removes the password from it, as it does from an HTTP echo."""
    from aiosmtpd.smtp import AuthResult

    from apps.notifications.sending import failure_of

    def authenticator(server, session, envelope, mechanism, auth_data):
        return AuthResult(success=False, handled=False,
                          message=f"535 5.7.8 bad credentials for {auth_data.login.decode()}"
                                  f" / {auth_data.password.decode()}")

    with smtp_relay_on_loopback(_Sink(), authenticator) as port:
        use_relay(settings, port, "mailer", "smtpLEAK-pa55word")
        backend = email_connection(fail_silently=False)
        with pytest.raises(Exception) as caught:  # noqa: B017 - smtplib.SMTPAuthenticationError
            backend.open()
    stored = failure_of(caught.value).error  # what Notification.error and the log line get
    assert "smtpLEAK-pa55word" not in stored, stored
    assert "535" in stored and "[redacted]" in stored


def test_an_smtps_handshake_trickled_by_the_relay_is_cut_at_the_deadline(settings):
    """``GATEWAY_SMTP_DEADLINE_SECONDS`` bounds "connect and log in" as a whole; with ``EMAIL_USE_SSL``
    the TLS handshake runs inside ``_get_socket``, before the backend knows the socket, so the
    deadline's shutdown finds nothing to shut: the handshake ends at EMAIL_TIMEOUT (CPython's own
    handshake deadline), not at the gateway's (here 3 s against 0.5 s)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve():
        conn, _ = srv.accept()
        try:
            conn.recv(4096)  # the ClientHello
            conn.sendall(b"\x16\x03\x03\x40\x00")  # a handshake record of 16 KiB is coming …
            while not stop.is_set():
                conn.sendall(b"\x02")  # … one byte at a time
                time.sleep(0.2)
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    settings.EMAIL_BACKEND = "apps.gateway.smtp.GatewayEmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS, settings.EMAIL_USE_SSL = False, True
    settings.EMAIL_HOST_USER, settings.EMAIL_HOST_PASSWORD, settings.EMAIL_HOST_PASSWORD_FILE = "", "", ""
    settings.EMAIL_TIMEOUT = 3
    settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_SMTP_DEADLINE_SECONDS": 0.5}
    backend = email_connection(fail_silently=False)
    result: dict = {}

    def run():
        started = time.monotonic()
        try:
            backend.open()
        except Exception as exc:  # noqa: BLE001
            result["exc"] = exc
        result["took"] = time.monotonic() - started

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5.0)
    stop.set()
    worker.join(3.0)
    srv.close()
    assert result.get("took", 99) < 1.5, f"the 0.5 s deadline held the open for {result.get('took')}"


def test_a_caller_cannot_turn_tls_off_for_the_login(settings):
    settings.EMAIL_BACKEND = "apps.gateway.smtp.GatewayEmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "mail.example", 587
    settings.EMAIL_USE_TLS, settings.EMAIL_USE_SSL = True, False
    settings.EMAIL_HOST_USER, settings.EMAIL_HOST_PASSWORD, settings.EMAIL_HOST_PASSWORD_FILE = "mailer", "pw", ""
    backend = GatewayEmailBackend(use_tls=False, use_ssl=False)
    assert (backend.use_tls, backend.use_ssl) == (True, False)
    settings.EMAIL_HOST_PASSWORD = ""  # no login: nothing to protect, the caller's choice holds
    assert GatewayEmailBackend(use_tls=False).use_tls is False


def test_a_slow_name_lookup_of_the_relay_is_cut_at_the_steps_deadline(settings, monkeypatch):
    slow_name_lookup(monkeypatch, "relay.slow-dns.test")
    with smtp_relay_on_loopback(_Sink()) as port:
        use_relay(settings, port)
        settings.EMAIL_HOST = "relay.slow-dns.test"
        settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_SMTP_DEADLINE_SECONDS": 0.5}
        backend = email_connection(fail_silently=False)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            backend.open()
        took = time.monotonic() - started
    assert took < 1.5, f"the 0.5 s step took {took:.1f} s"
    assert GatewayCall.objects.get(tool="notifications.smtp", method="CONNECT").outcome == "timeout"


def test_the_open_a_send_makes_keeps_the_sends_deadline_and_both_are_recorded(smtp_relay, settings):
    sink, port = smtp_relay
    settings.EMAIL_BACKEND = "apps.gateway.smtp.GatewayEmailBackend"
    backend = email_connection(fail_silently=False)
    assert backend.send_messages([_message()]) == 1
    outcomes = sorted(GatewayCall.objects.filter(port=port).values_list("method", "outcome"))
    assert outcomes == [("CONNECT", "ok"), ("SEND", "ok")]
    assert backend._deadline_at is None  # the send's deadline ended with it, not with the open inside it
    assert len(sink.messages) == 1
