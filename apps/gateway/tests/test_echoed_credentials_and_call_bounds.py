"""What a caller, a trace and a model get from the tool gateway (ADR 0022; spec §16.6): no credential
echoed in a header's name, inside a JSON string the caller parses again, in a span, in a spelling the
caller could decode, or (another tool's) in a request to the model; and the bounds of a call: an
answer in several gzip members, a listed URL that cannot be read, a name that takes long to resolve."""

from __future__ import annotations

import base64
import gzip
import json
import re
import time
from urllib.parse import unquote

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apps.core import tool_errors as errors
from apps.gateway import errors as gateway_errors
from apps.gateway.http import http_request
from apps.gateway.models import GatewayCall
from apps.gateway.tests.servers import slow_name_lookup
from apps.gateway.tests.test_http import configure, use
from config.tracing import setup_tracing, teardown_tracing

pytestmark = pytest.mark.django_db

#: a django-helpdesk (DRF) token: 40 lower-case hex digits — also a valid header *name*
HEX_TOKEN = "9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c0b2d4f6e"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert setup_tracing("test", exporter=exporter) is True
    yield exporter
    teardown_tracing()


def _span_text(exporter) -> str:
    out = []
    for s in exporter.get_finished_spans():
        out.append(repr(dict(s.attributes or {})))
        out.append(repr(s.status.description))
        out.extend(repr(dict(e.attributes or {})) for e in s.events)
    return "\n".join(out)


def test_a_credential_echoed_as_a_response_header_name_does_not_reach_the_caller(settings, recorder):
    """A server answering ``<token>: 1`` (a hex token is a valid header name): the header is dropped,
    names are checked as values are."""

    def answer(handler):
        token = handler.headers["Authorization"].partition(" ")[2]
        handler.send_response(200)
        handler.send_header(token, "1")
        handler.send_header("Content-Length", "2")
        handler.end_headers()
        handler.wfile.write(b"{}")

    server = recorder({"GET /helpdesk/api/x": answer})
    configure(settings, "ticket.helpdesk", server.url, HEX_TOKEN)
    resp = http_request("ticket.helpdesk", "GET", f"{server.url}/helpdesk/api/x", timeout=5)
    assert HEX_TOKEN not in repr(resp.headers.multi_items())


def test_a_credential_escaped_inside_the_model_content_string_never_reaches_the_parsed_output(settings, recorder):
    """The model's ``content`` is a JSON string the provider parses again: an echo written as ``\\u``
    escapes inside that inner JSON is scrubbed from the content and from the parsed output (the draft
    that would become a ticket and events)."""
    secret = "sk-model-LEAK-0123456789"

    def answer(handler):
        key = handler.headers["Authorization"].partition(" ")[2]
        escaped = "".join(f"\\u{ord(c):04x}" for c in key)
        inner = ('{"title": "Printer jam", "description": "key ' + escaped + '", "priority": "P3", '
                 '"alert_summary": "jam", "evidence": [], "missing_information": []}')
        data = json.dumps({"choices": [{"finish_reason": "stop", "message": {"content": inner}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    server = recorder({"POST /v1/chat/completions": answer})
    configure(settings, "model", server.url, secret)
    _, result = use("model", server.url)
    assert result.outcome == "ok", (result.outcome, result.problems)
    assert secret not in repr(result.output) + repr(result.content)


def test_an_http_error_quoting_an_echoed_credential_never_reaches_a_span(settings, recorder, spans):
    """h11's "illegal header line: b'…'" quotes the server's line: neither the gateway's error nor its
    span (exported to a collector) keeps the credential — the span holds the outcome class only."""
    secret = "ref-span-LEAK-abcdef123456"

    def answer(handler):
        auth = handler.headers["Authorization"]
        handler.wfile.write(b"HTTP/1.1 401 Unauthorized\r\nyou sent " + auth.encode() + b"\r\n\r\n")
        handler.close_connection = True

    server = recorder({"GET /tickets": answer})
    configure(settings, "ticket.reference", server.url, secret)
    with pytest.raises(gateway_errors.TransportFailed) as caught:
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    assert secret not in str(caught.value)  # holds: the gateway's own message is scrubbed
    assert secret not in _span_text(spans)


def test_capturing_client_request_headers_on_spans_never_exports_the_injected_credential(settings, recorder,
                                                                                          monkeypatch):
    """``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_REQUEST`` (a standard OTel setting an operator
    may set to debug a connector) never puts the injected ``Authorization`` on a span: the gateway's
    own span carries no header."""
    monkeypatch.setenv("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_CLIENT_REQUEST", ".*")
    exporter = InMemorySpanExporter()
    assert setup_tracing("test", exporter=exporter) is True
    try:
        secret = "ref-hdr-LEAK-abcdef123456"
        server = recorder({"GET /tickets": (200, {}, b'{"results": []}')})
        configure(settings, "ticket.reference", server.url, secret)
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
        text = _span_text(exporter)
    finally:
        teardown_tracing()
    assert "/tickets" in text  # the span is there
    assert secret not in text


def test_an_answer_in_several_gzip_members_is_read_whole_or_refused(settings, recorder):
    """A gzip body may hold several members (RFC 1952 §2.2; ``cat a.gz b.gz``, streaming servers): the
    caller gets all of them, never the first alone recorded as ``ok``."""
    first, second = b'{"results": [', b'{"id": "T-1", "version": 1}]}'
    data = gzip.compress(first) + gzip.compress(second)

    def answer(handler):
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Encoding", "gzip")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    server = recorder({"GET /tickets": answer})
    configure(settings, "ticket.reference", server.url, "k3y")
    try:
        resp = http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    except gateway_errors.GatewayError:
        return  # refusing it is fine too
    assert resp.content == first + second


def test_a_listed_url_the_gateway_cannot_read_is_a_recorded_gateway_error_not_a_crash(settings, recorder):
    """A listed URL that cannot be read (``https://proxy.example:99999``) makes every call of the tool a
    recorded refusal the connector maps — never a bare ``ValueError`` — and production refuses it."""
    server = recorder({"GET /tickets": (200, {}, b'{"results": []}')})
    configure(settings, "ticket.reference", server.url, "k3y")
    allow = {**settings.FAULTDESK.get("GATEWAY_ALLOW", {}), "ticket.reference": ["https://proxy.example:99999"]}
    settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_ALLOW": allow}
    from config.deploy_checks import _allow_list_problem
    assert "cannot be read" in _allow_list_problem(settings.FAULTDESK)  # production would not start with it
    try:
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    except gateway_errors.GatewayError:
        pass
    except ValueError as exc:
        pytest.fail(f"an unclassified {exc!r} escaped the gateway")
    assert GatewayCall.objects.filter(tool="ticket.reference").exists()


def test_a_slow_name_resolution_is_bounded_by_the_calls_deadline(settings, recorder, monkeypatch):
    """The name lookup (``getaddrinfo`` takes no timeout: resolv.conf's 5 s × attempts × servers) waits at
    most the call's time left: a resolver that takes 3 s ends a 0.5 s call at about 0.5 s."""
    server = recorder({"GET /tickets": (200, {}, b'{"results": []}')})
    port = server.server_address[1]
    slow_name_lookup(monkeypatch, "tickets.slow-dns.test")
    url = f"http://tickets.slow-dns.test:{port}"
    configure(settings, "ticket.reference", url, "k3y")
    started = time.monotonic()
    try:
        http_request("ticket.reference", "GET", f"{url}/tickets", timeout=0.5)
    except gateway_errors.GatewayError:
        pass
    took = time.monotonic() - started
    assert took < 1.5, f"a 0.5 s call took {took:.1f} s"


# --- spellings not yet covered ----------------------------------------------------------------------

_B64_SECRET = "AbC/dEf+ref-s3cret/LEAK"


def _lower_percent(text: str) -> str:
    """Percent-encoding with lower-case hex digits (RFC 3986 §2.1: equivalent to upper case; Go's and
    several proxies' encoders write it so)."""
    from urllib.parse import quote
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quote(text, safe=""))


def _echo_body(encode):
    def answer(handler):
        data = json.dumps({"error": "unauthorized", "detail": encode(handler.headers["Authorization"])}).encode()
        handler.send_response(401)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return answer


@pytest.mark.parametrize("encode", [
    lambda auth: _lower_percent(auth),
    lambda auth: base64.b64encode(auth.encode()).decode(),
], ids=["lower-case-percent", "base64"])
def test_an_echo_the_caller_could_decode_is_not_stored_in_the_connectors_error(encode, settings, recorder):
    """An answer echoing ``Authorization`` percent-encoded in lower case, or base64-encoded, leaves
    nothing in the Unauthorized error the dispatcher records (detail and body) that decodes back to
    the credential."""
    server = recorder({"GET /tickets": _echo_body(encode)})
    configure(settings, "ticket.reference", server.url, _B64_SECRET)
    _, outcome = use("ticket.reference", server.url)
    assert isinstance(outcome, errors.Unauthorized), outcome
    stored = repr(outcome.as_dict()) + repr(outcome.body)
    assert _B64_SECRET not in stored  # holds: not raw
    decoded = [unquote(stored)]
    decoded += [base64.b64decode(t + "==").decode("latin-1") for t in re.findall(r"[A-Za-z0-9+/]{16,}", stored)]
    assert not any(_B64_SECRET in d for d in decoded), "the stored error decodes back to the credential"


def test_a_redirect_location_echoing_the_credential_is_not_handed_to_the_caller(settings, recorder):
    """A 3xx is an answer whose headers reach the caller: a ``Location`` carrying the key percent-encoded
    in lower case is dropped."""

    def answer(handler):
        key = handler.headers["Authorization"].partition(" ")[2]
        handler.send_response(302)
        handler.send_header("Location", f"https://sso.example/login?api_key={_lower_percent(key)}")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = recorder({"GET /tickets": answer})
    configure(settings, "ticket.reference", server.url, _B64_SECRET)
    resp = http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    assert resp.status_code == 302
    assert _B64_SECRET not in unquote(repr(resp.headers.multi_items()))


# --- what the model is sent -------------------------------------------------------------------------

def test_no_other_tools_credential_is_sent_to_the_model(settings, recorder):
    """§16.6: credentials never in the model's context. A device's ``alert_message`` or a ticket comment
    quoting another tool's credential (a monitoring agent's "auth failed for token …") reaches the
    model server as ``[redacted]``: the gateway, which knows every credential, scrubs what it sends."""
    server = recorder({"POST /v1/chat/completions": (200, {}, b'{"choices": []}')})
    configure(settings, "model", server.url, "sk-model-key")
    settings.FAULTDESK = {**settings.FAULTDESK, "HELPDESK_API_TOKEN": HEX_TOKEN}
    alert = f"helpdesk sync failed: 401 for token {HEX_TOKEN}"
    http_request("model", "POST", f"{server.url}/v1/chat/completions", timeout=5,
                 json={"model": "m", "messages": [{"role": "user", "content": f"Device alert: {alert}"}]})
    assert server.seen, "the model server was called"
    assert HEX_TOKEN not in server.seen[-1]["body"].decode()
