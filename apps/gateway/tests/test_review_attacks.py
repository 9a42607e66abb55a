"""Adversarial review of the tool gateway (ADR 0022): each test is a finding — it fails on main."""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from apps.core import tool_errors as errors
from apps.gateway import errors as gateway_errors
from apps.gateway.http import http_request
from apps.gateway.models import GatewayCall
from apps.gateway.tests.servers import CountingListener, Recorder
from apps.gateway.tests.test_http import configure, use

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")]

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def recorder():
    servers = []

    def start(answers):
        server = Recorder(answers)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


# --- caps: a compressed answer ------------------------------------------------------------------------

def _raw(status: int, headers: dict, data: bytes):
    def answer(handler):
        handler.send_response(status)
        for k, v in headers.items():
            handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return answer


def test_a_nested_gzip_answer_is_not_decoded_whole_past_the_cap(settings, recorder):
    """The gateway asks for ``identity``, but a server may compress anyway; the ADR says the cap counts
    decoded bytes "a chunk at a time". With ``Content-Encoding: gzip, gzip`` a ~1 KB answer is one raw
    chunk that httpx's MultiDecoder inflates to 256 MiB in one go, before the cap (64 KiB here) is
    looked at: the cap bounds nothing in memory."""
    inner = gzip.compress(b"\0" * (256 * 2**20), compresslevel=9)
    bomb = gzip.compress(inner, compresslevel=9)
    assert len(bomb) < 64 * 1024
    server = recorder({"GET /tickets": _raw(200, {"Content-Encoding": "gzip, gzip"}, bomb)})
    configure(settings, "ticket.reference", server.url, "k3y-value")
    settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_TICKET_MAX_RESPONSE_BYTES": 64 * 1024}
    tracemalloc.start()
    try:
        with pytest.raises(gateway_errors.ResponseTooLarge):
            http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"a 64 KiB cap let {peak / 2**20:.0f} MiB be decoded in memory"


# --- credential leaks -------------------------------------------------------------------------------

def _echo(status: int, *, content_type: str, encode):
    def answer(handler):
        data = encode(handler.headers["Authorization"])
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return answer


@pytest.mark.parametrize(("content_type", "encode"), [
    # a JSON encoder that escapes "/" (PHP's json_encode, several Java ones): a base64 key holds "/"
    ("application/json", lambda auth: json.dumps({"error": "unauthorized", "detail": auth}).replace("/", "\\/")
     .encode()),
    # a JSON encoder that writes \\u escapes
    ("application/json", lambda auth: ('{"error": "unauthorized", "detail": "'
                                       + "".join(f"\\u{ord(c):04x}" for c in auth) + '"}').encode()),
    # a server that answers in UTF-16 (httpx decodes by the charset)
    ("text/plain; charset=utf-16", lambda auth: f"unauthorized: {auth}".encode("utf-16")),
], ids=["json-escaped-slash", "json-unicode-escapes", "utf-16"])
def test_an_echoed_credential_is_redacted_in_what_the_caller_reads_not_only_in_its_bytes(
        content_type, encode, settings, recorder):
    """The gateway redacts the credential's *bytes* in the body; the caller reads ``resp.json()`` /
    ``resp.text``, where an escaped or differently encoded echo decodes back to the credential —
    then kept in the connector's error (detail/body, which the dispatch events record)."""
    secret = "AbC/dEf+ref-s3cret/LEAK"
    server = recorder({"GET /tickets": _echo(401, content_type=content_type, encode=encode)})
    configure(settings, "ticket.reference", server.url, secret)
    _, outcome = use("ticket.reference", server.url)
    assert isinstance(outcome, errors.Unauthorized), outcome
    assert secret not in repr(outcome.as_dict()) + repr(outcome.body)


def test_a_credential_the_http_stack_rejects_never_appears_in_the_error(settings, recorder, tmp_path):
    """A mounted secret file holding two lines (a rotation left both keys in it): h11 refuses the
    header and its message quotes the whole header value, which the gateway puts in TransportFailed's
    detail, the connector in OutcomeUnknown's detail (recorded by the dispatcher) — and the call is
    classed "perhaps sent" although no request byte left."""
    server = recorder({})
    path = tmp_path / "key"
    path.write_text("old-LEAK-key-1\nnew-LEAK-key-2\n")
    configure(settings, "ticket.reference", server.url, "", secret_file=str(path))
    _, outcome = use("ticket.reference", server.url)
    assert isinstance(outcome, errors.ToolError), outcome
    text = repr(outcome.as_dict())
    assert "LEAK-key" not in text, text
    assert server.seen == []
    assert isinstance(outcome, errors.DefinitelyNotExecuted), "nothing was sent, yet it is 'outcome unknown'"


def test_a_model_credential_the_http_stack_rejects_never_appears_in_the_model_call_record(settings, recorder,
                                                                                          tmp_path):
    """The same through the model provider: its redaction looks for the raw secret, the message holds
    its repr (``\\n`` escaped), so the recorded error keeps it."""
    server = recorder({})
    path = tmp_path / "key"
    path.write_text("old-LEAK-model-1\nnew-LEAK-model-2\n")
    configure(settings, "model", server.url, "", secret_file=str(path))
    _, result = use("model", server.url)
    assert "LEAK-model" not in repr(result.error) + repr(result.problems), result.error


def test_an_smtp_reply_echoing_the_password_is_redacted(settings):
    """An SMTP relay's 535 may quote what it was sent; the sender stores the reply (Notification.error,
    a log line): the gateway redacts HTTP echoes but not SMTP ones."""
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult

    from apps.gateway.smtp import email_connection
    from apps.notifications.sending import failure_of

    class Sink:
        async def handle_DATA(self, server, session, envelope):  # noqa: N802
            return "250 OK"

    def authenticator(server, session, envelope, mechanism, auth_data):
        return AuthResult(success=False, handled=False,
                          message=f"535 5.7.8 bad credentials for {auth_data.login.decode()}"
                                  f" / {auth_data.password.decode()}")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    controller = Controller(Sink(), hostname="127.0.0.1", port=port, authenticator=authenticator,
                            auth_required=True, auth_require_tls=False)
    controller.start()
    try:
        settings.EMAIL_BACKEND = "apps.gateway.smtp.GatewayEmailBackend"
        settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
        settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
        settings.EMAIL_HOST_USER, settings.EMAIL_HOST_PASSWORD = "mailer", "smtpLEAK-pa55word"
        settings.EMAIL_HOST_PASSWORD_FILE = ""
        settings.EMAIL_TIMEOUT = 5
        backend = email_connection(fail_silently=False)
        with pytest.raises(Exception) as caught:
            backend.open()
    finally:
        controller.stop()
    stored = failure_of(caught.value).error  # what Notification.error and the log line get
    assert "smtpLEAK-pa55word" not in stored, stored


# --- caps: the SMTP deadline ------------------------------------------------------------------------

def test_an_smtps_handshake_trickled_by_the_relay_is_cut_at_the_deadline(settings):
    """``GATEWAY_SMTP_DEADLINE_SECONDS`` bounds "connect and log in" as a whole; with ``EMAIL_USE_SSL``
    the TLS handshake runs inside ``_get_socket``, before the backend knows the socket, so the
    deadline's shutdown finds nothing to shut: the handshake ends at EMAIL_TIMEOUT (CPython's own
    handshake deadline), not at the gateway's (here 3 s against 0.5 s)."""
    from apps.gateway.smtp import email_connection

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


# --- bypass -------------------------------------------------------------------------------------------

def test_span_export_goes_through_the_gateway_or_nowhere(tmp_path):
    """config/tracing.py's OTLP exporter (opentelemetry-exporter-otlp-proto-http: ``requests``) posts
    spans to ``OTEL_EXPORTER_OTLP_ENDPOINT`` itself: no destination list, no record, environment
    proxies and .netrc honoured. Run in a process of its own (tracing is global per process)."""
    listener = CountingListener()
    try:
        script = textwrap.dedent("""
            import django, os
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")
            django.setup()
            from opentelemetry import trace
            from config.tracing import setup_tracing
            assert setup_tracing("web")
            with trace.get_tracer("review").start_as_current_span("probe"):
                pass
            trace.get_tracer_provider().force_flush(5000)
        """)
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": listener.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
               "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, timeout=60, capture_output=True)
        time.sleep(0.2)
        assert listener.accepts == 0, "an outbound call left the process outside the tool gateway"
    finally:
        listener.close()


def test_the_credential_scan_sees_a_read_through_the_gateways_own_module():
    """The AST scan looks for the *names* of the credential settings; any product module may import
    ``apps.gateway.credentials`` (apps/llm/providers.py does, for ``redact``) and call
    ``secret(tool)`` or ``authorization(tool)`` — or build the name — and the scan passes."""
    from tests.test_credentials_stay_in_the_gateway import names_of_secrets

    sidesteps = [
        'from apps.gateway import credentials\nkey = credentials.secret("model")\n',
        'from apps.gateway.credentials import authorization\nheaders = authorization("ticket.reference")\n',
        'from django.conf import settings\npw = getattr(settings, "EMAIL_HOST_" + "PASSWORD")\n',
        'from django.conf import settings\nkey = settings.FAULTDESK["MODEL_API_" + "KEY"]\n',
    ]
    missed = [s for s in sidesteps if not names_of_secrets(s)]
    assert missed == [], missed


def test_a_refused_destination_leaves_nothing_recorded_with_its_query(settings, recorder):
    """Sanity (holds): the record of a refused call keeps the path, never the query."""
    server = recorder({})
    configure(settings, "ticket.reference", server.url, "k3y")
    with pytest.raises(gateway_errors.DestinationRefused):
        http_request("ticket.reference", "GET", "http://elsewhere.invalid/x?token=abc", timeout=1)
    row = GatewayCall.objects.get(host="elsewhere.invalid")
    assert row.path == "/x"
