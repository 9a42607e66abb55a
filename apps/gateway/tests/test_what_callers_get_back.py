"""What a caller of the tool gateway gets back (ADR 0022): an answer bounded by the cap however it is
encoded, and never the credential — not in the body in any spelling it could decode, not in an error
message, not when the credential itself cannot be sent."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib
from pathlib import Path
from urllib.parse import quote

import pytest

from apps.core import tool_errors as errors
from apps.gateway import errors as gateway_errors
from apps.gateway.http import http_request
from apps.gateway.models import GatewayCall
from apps.gateway.tests.test_http import configure, use

pytestmark = [pytest.mark.django_db,
              pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")]

ROOT = Path(__file__).resolve().parents[3]


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




def test_a_refused_destination_leaves_nothing_recorded_with_its_query(settings, recorder):
    """Sanity (holds): the record of a refused call keeps the path, never the query."""
    server = recorder({})
    configure(settings, "ticket.reference", server.url, "k3y")
    with pytest.raises(gateway_errors.DestinationRefused):
        http_request("ticket.reference", "GET", "http://elsewhere.invalid/x?token=abc", timeout=1)
    row = GatewayCall.objects.get(host="elsewhere.invalid")
    assert row.path == "/x"


@pytest.mark.parametrize(("encoding", "encode"), [
    ("gzip", lambda data: gzip.compress(data)),
    ("deflate", lambda data: zlib.compress(data)),  # a zlib stream, as the RFC has it
    ("deflate", lambda data: zlib.compress(data)[2:-4]),  # the raw deflate some servers send
    ("gzip, gzip", lambda data: gzip.compress(gzip.compress(data))),
    ("identity", lambda data: data),
], ids=["gzip", "deflate-zlib", "deflate-raw", "gzip-twice", "identity"])
def test_a_compressed_answer_under_the_cap_reaches_the_caller_decoded(settings, recorder, encoding, encode):
    payload = json.dumps({"tickets": [{"id": f"REF-{i:06d}", "title": "打印机卡纸 paper jam"} for i in range(300)]},
                         ensure_ascii=False).encode()
    server = recorder({"GET /tickets": _raw(200, {"Content-Encoding": encoding,
                                                  "Content-Type": "application/json"}, encode(payload))})
    configure(settings, "ticket.reference", server.url, "k3y-value")
    answer = http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=10)
    assert answer.content == payload
    assert answer.json()["tickets"][299]["id"] == "REF-000299"
    assert "content-encoding" not in answer.headers
    row = GatewayCall.objects.get(tool="ticket.reference")
    assert (row.outcome, row.bytes_received) == ("ok", len(payload))


def test_a_single_gzip_layer_past_the_cap_is_cut_at_the_cap(settings, recorder):
    bomb = gzip.compress(b"\0" * (8 * 2**20), compresslevel=9)
    server = recorder({"GET /tickets": _raw(200, {"Content-Encoding": "gzip"}, bomb)})
    configure(settings, "ticket.reference", server.url, "k3y-value")
    settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_TICKET_MAX_RESPONSE_BYTES": 64 * 1024}
    with pytest.raises(gateway_errors.ResponseTooLarge):
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=10)
    row = GatewayCall.objects.get(tool="ticket.reference")
    assert row.outcome == "too_large" and row.bytes_received <= 64 * 1024


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_an_answer_in_an_encoding_the_gateway_does_not_decode_is_not_read(settings, recorder, encoding):
    server = recorder({"GET /tickets": _raw(200, {"Content-Encoding": encoding}, b"\x1b\x00\x00")})
    configure(settings, "ticket.reference", server.url, "k3y-value")
    with pytest.raises(gateway_errors.TransportFailed, match="does not decode"):
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=10)
    assert GatewayCall.objects.get(tool="ticket.reference").outcome == "transport_error"


def test_a_corrupt_compressed_answer_is_a_transport_failure_not_a_crash(settings, recorder):
    server = recorder({"GET /tickets": _raw(200, {"Content-Encoding": "gzip"}, b"\x1f\x8bnot gzip at all")})
    configure(settings, "ticket.reference", server.url, "k3y-value")
    with pytest.raises(gateway_errors.TransportFailed):
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=10)


@pytest.mark.parametrize("secret", ["two\nlines-of-key", "ключ-non-ascii-key", " padded-key\t", "nul\0key"],
                         ids=["line-break", "non-ascii", "whitespace", "nul"])
def test_a_credential_that_cannot_be_a_header_is_refused_unsent_and_recorded(settings, recorder, secret):
    server = recorder({})
    configure(settings, "ticket.reference", server.url, secret)
    with pytest.raises(gateway_errors.ConnectFailed) as caught:
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    assert "key" not in str(caught.value)
    assert server.seen == []
    assert GatewayCall.objects.get(tool="ticket.reference").outcome == "bad_credential"


def test_an_echo_in_a_header_or_a_percent_encoded_body_is_redacted_too(settings, recorder):
    secret = "AbC/dEf+ref s3cret"

    def answer(handler):
        auth = handler.headers["Authorization"].partition(" ")[2]
        data = f"token={quote(auth, safe='')}&again={quote(auth)}".encode()
        handler.send_response(401)
        handler.send_header("Content-Type", "application/x-www-form-urlencoded")
        handler.send_header("X-Echo", auth)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    server = recorder({"GET /tickets": answer})
    configure(settings, "ticket.reference", server.url, secret)
    got = http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    assert got.status_code == 401
    assert "x-echo" not in got.headers
    assert got.text == "token=[redacted]&again=[redacted]"


@pytest.mark.parametrize("url_tail", ["/tick\tets", "/tickets\x00", "/ticket s\r\nX-Injected: 1"])
def test_a_url_that_cannot_be_sent_is_refused_unsent_and_recorded(settings, recorder, url_tail):
    server = recorder({})
    configure(settings, "ticket.reference", server.url, "k3y-value")
    with pytest.raises(gateway_errors.GatewayError) as caught:
        http_request("ticket.reference", "GET", f"{server.url}{url_tail}", timeout=5)
    assert caught.value.sent is False  # a definite "not executed", never a crash or "outcome unknown"
    assert server.seen == []
    assert GatewayCall.objects.get(tool="ticket.reference").outcome in {"connect_error", "refused_destination"}
