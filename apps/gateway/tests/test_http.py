"""The tool gateway's HTTP tools through the code that uses them (ADR 0022; spec §16.6): for each tool
— the reference ticket service's and django-helpdesk's connectors, the model provider, the remote
embedding model — a destination outside the list is refused before any connection is made, and is
recorded; the credential reaches the server while the connector or provider never holds it; a redirect
is never followed; and an answer that is too large, or too slow, is cut and classed."""

from __future__ import annotations

import json
import time

import pytest

from apps.core import tool_errors as errors
from apps.evidence.embedding import embed_texts
from apps.gateway import errors as gateway_errors
from apps.gateway.http import http_request
from apps.gateway.models import GatewayCall
from apps.gateway.tests.servers import CountingListener, trickle, trickled_headers
from apps.llm.providers import OpenAICompatibleProvider
from apps.tickets.connectors import HelpdeskConnector, ReferenceTicketConnector

pytestmark = pytest.mark.django_db

HTTP_TOOLS = ("ticket.reference", "ticket.helpdesk", "model", "embeddings")
#: tool -> (the setting of its base URL, of its secret, the secret's header scheme)
_SETTINGS = {"ticket.reference": ("REFSERVICE_URL", "REFSERVICE_API_KEY", "Bearer"),
             "ticket.helpdesk": ("HELPDESK_URL", "HELPDESK_API_TOKEN", "Token"),
             "model": ("MODEL_BASE_URL", "MODEL_API_KEY", "Bearer"),
             "embeddings": ("EMBEDDING_MODEL", "EMBEDDING_API_KEY", "Bearer")}
_COMPLETION = {"choices": [{"finish_reason": "stop", "message": {"content": json.dumps({
    "title": "Printer jam", "description": "The printer jams on every page.", "priority": "P3",
    "alert_summary": "jam", "evidence": [], "missing_information": []})}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 10}}
#: what each tool's server answers (the paths its code calls)
ANSWERS = {
    "GET /tickets": (200, {}, b'{"results": []}'),
    "GET /helpdesk/api/faultdesk/tickets/by-custom-field/": (200, {}, b'{"results": []}'),
    "POST /v1/chat/completions": (200, {}, json.dumps(_COMPLETION).encode()),
    "POST /v1/embeddings": (200, {}, b'{"data": [{"index": 0, "embedding": [1.0, 0.0]}]}'),
}
_PATHS = {"ticket.reference": "/tickets", "ticket.helpdesk": "/helpdesk/api/faultdesk/tickets/by-custom-field/",
          "model": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


def configure(settings, tool: str, url: str, secret: str = "", *, secret_file: str = "") -> None:
    """Point ``tool``'s configuration at ``url`` with ``secret`` (or the file holding it)."""
    url_name, secret_name, _ = _SETTINGS[tool]
    value = {"MODEL_BASE_URL": f"{url}/v1", "EMBEDDING_MODEL": f"openai:{url}#emb"}.get(url_name, url)
    settings.FAULTDESK = {**settings.FAULTDESK, url_name: value, secret_name: secret,
                          f"{secret_name}_FILE": secret_file}


def use(tool: str, base: str):
    """Call ``base`` as the code of ``tool`` does; returns ``(the object that made the call, its result or
    the exception it raised)``."""
    if tool == "ticket.reference":
        obj = ReferenceTicketConnector(base_url=base, timeout=5)
        fn = lambda: obj.lookup_by_key(idempotency_key="acme:ticket.create:k")  # noqa: E731
    elif tool == "ticket.helpdesk":
        obj = HelpdeskConnector(base_url=base, timeout=5)
        fn = lambda: obj.lookup_by_key(idempotency_key="acme:ticket.create:k")  # noqa: E731
    elif tool == "model":
        obj = OpenAICompatibleProvider(base_url=f"{base}/v1", model="m", max_output_tokens=50, units_per_1k=1.0)
        fn = lambda: obj.complete([{"role": "user", "content": "hi"}], timeout=5)  # noqa: E731
    else:
        obj = None
        fn = lambda: embed_texts(["a printer jams"], model=f"openai:{base}#emb")  # noqa: E731
    try:
        return obj, fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what was raised
        return obj, exc


def refused(tool: str, outcome) -> bool:
    """Did the code of ``tool`` take the refusal as "never sent"?"""
    if tool.startswith("ticket."):
        return isinstance(outcome, errors.DefinitelyNotExecuted) and "refused" in outcome.detail
    if tool == "model":
        return outcome.outcome == "error" and outcome.sent is False and "refused by the tool gateway" in outcome.error
    return isinstance(outcome, gateway_errors.DestinationRefused)


@pytest.fixture
def listener():
    server = CountingListener()
    yield server
    server.close()


@pytest.mark.parametrize("tool", HTTP_TOOLS)
def test_another_port_on_loopback_is_refused_before_any_connection_and_recorded(tool, settings, recorder, listener):
    configured = recorder(ANSWERS)
    configure(settings, tool, configured.url, "s3cret-value")
    _, outcome = use(tool, listener.url)
    assert refused(tool, outcome), outcome
    time.sleep(0.1)
    assert listener.accepts == 0, "no connection may reach an address outside the list"
    assert configured.seen == []
    row = GatewayCall.objects.get(tool=tool, port=listener.port)
    assert (row.outcome, row.host, row.scheme, row.http_status, row.path) == \
        ("refused_destination", "127.0.0.1", "http", None, _PATHS[tool])


@pytest.mark.parametrize("tool", HTTP_TOOLS)
def test_another_host_is_refused_and_recorded(tool, settings, recorder):
    configured = recorder(ANSWERS)
    configure(settings, tool, configured.url, "s3cret-value")
    port = configured.server_address[1]
    _, outcome = use(tool, f"http://elsewhere.invalid:{port}")
    assert refused(tool, outcome), outcome
    assert GatewayCall.objects.filter(tool=tool, host="elsewhere.invalid", outcome="refused_destination").exists()


@pytest.mark.parametrize("tool", HTTP_TOOLS)
def test_a_redirect_to_an_unlisted_address_is_not_followed(tool, settings, recorder, listener):
    path = _PATHS[tool]
    method = "GET" if tool.startswith("ticket.") else "POST"
    configured = recorder({f"{method} {path}": (302, {"Location": f"{listener.url}{path}"}, b"")})
    configure(settings, tool, configured.url, "s3cret-value")
    _, outcome = use(tool, configured.url)
    assert not isinstance(outcome, (dict, list)) and outcome is not None
    time.sleep(0.1)
    assert listener.accepts == 0
    assert len(configured.seen) == 1
    row = GatewayCall.objects.get(tool=tool, port=configured.server_address[1])
    assert (row.outcome, row.http_status) == ("redirect", 302)
    if tool.startswith("ticket."):
        assert isinstance(outcome, errors.OutcomeUnknown)  # a 3xx proves nothing either way


@pytest.mark.parametrize("from_file", [False, True], ids=["setting", "file"])
@pytest.mark.parametrize("tool", HTTP_TOOLS)
def test_the_server_sees_the_credential_the_code_was_never_handed(tool, from_file, settings, recorder, tmp_path):
    secret = f"dist1nct-{tool}-secret-{'file' if from_file else 'env'}"
    configured = recorder(ANSWERS)
    if from_file:
        path = tmp_path / "secret"
        path.write_text(secret + "\n")
        configure(settings, tool, configured.url, "", secret_file=str(path))
    else:
        configure(settings, tool, configured.url, secret)
    obj, outcome = use(tool, configured.url)
    assert not isinstance(outcome, Exception), outcome
    [request] = configured.seen
    assert request["headers"]["Authorization"] == f"{_SETTINGS[tool][2]} {secret}"
    assert secret not in repr(vars(obj) if obj is not None else {})
    assert secret not in repr(outcome)
    row = GatewayCall.objects.get(tool=tool, port=configured.server_address[1])
    assert row.outcome == "ok" and row.http_status == 200 and row.bytes_received > 0


def test_a_rotated_secret_file_is_read_again(settings, recorder, tmp_path):
    configured = recorder(ANSWERS)
    path = tmp_path / "key"
    path.write_text("first-key-value")
    configure(settings, "ticket.reference", configured.url, "", secret_file=str(path))
    use("ticket.reference", configured.url)
    path.write_text("second-key-value-longer")
    use("ticket.reference", configured.url)
    assert [r["headers"]["Authorization"] for r in configured.seen] == ["Bearer first-key-value",
                                                                        "Bearer second-key-value-longer"]


def test_an_unreadable_secret_file_sends_nothing(settings, recorder, tmp_path):
    configured = recorder(ANSWERS)
    configure(settings, "ticket.reference", configured.url, "", secret_file=str(tmp_path / "missing"))
    _, outcome = use("ticket.reference", configured.url)
    assert isinstance(outcome, errors.DefinitelyNotExecuted) and configured.seen == []


def test_a_listed_destination_is_reached_without_being_the_configured_one(settings, recorder):
    """A fault proxy in front of a ticket system (chaos, the end-to-end stack) is allowed by
    configuration: FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE."""
    configured, proxy = recorder(ANSWERS), recorder(ANSWERS)
    configure(settings, "ticket.reference", configured.url, "k3y-value")
    settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_ALLOW": {**settings.FAULTDESK["GATEWAY_ALLOW"],
                                                                  "ticket.reference": [proxy.url]}}
    _, outcome = use("ticket.reference", proxy.url)
    assert outcome is None and len(proxy.seen) == 1
    _, outcome = use("ticket.helpdesk", proxy.url)  # listed for one tool only
    assert refused("ticket.helpdesk", outcome) and len(proxy.seen) == 1


# --- caps ---------------------------------------------------------------------------------------------

def test_an_oversized_answer_is_cut_at_the_cap_and_classed(settings, recorder):
    big = recorder({"GET /tickets": (200, {}, b'{"results": [' + b'"x",' * 4000 + b'"x"]}')})
    configure(settings, "ticket.reference", big.url, "k3y-value")
    settings.FAULTDESK = {**settings.FAULTDESK, "GATEWAY_TICKET_MAX_RESPONSE_BYTES": 4096}
    with pytest.raises(gateway_errors.ResponseTooLarge) as caught:
        http_request("ticket.reference", "GET", f"{big.url}/tickets", timeout=5)
    assert caught.value.status == 200
    _, outcome = use("ticket.reference", big.url)
    assert isinstance(outcome, errors.OutcomeUnknown)  # handled, but what it said is unknown
    rows = list(GatewayCall.objects.filter(port=big.server_address[1]))
    assert [r.outcome for r in rows] == ["too_large"] * 2
    assert all(4096 < r.bytes_received <= 4096 + 65536 for r in rows)


def test_an_oversized_model_reply_is_malformed_and_not_read_further(settings, recorder):
    big = recorder({"POST /v1/chat/completions": (200, {}, b"x" * 200_000)})
    configure(settings, "model", big.url, "k3y-value")
    settings.FAULTDESK = {**settings.FAULTDESK, "MODEL_MAX_REPLY_BYTES": 10_000}
    _, result = use("model", big.url)
    assert result.outcome == "malformed" and "larger than 10000 bytes" in result.problems[0]
    assert GatewayCall.objects.get(port=big.server_address[1]).outcome == "too_large"


@pytest.mark.parametrize("answer", [trickle(1000, 0.05), trickled_headers(0.05)], ids=["body", "headers"])
def test_a_trickling_answer_is_cut_at_the_whole_calls_deadline(answer, settings, recorder):
    """httpx's timeout bounds each read; a server sending a byte (or a header line) every 50 ms never
    trips it. The gateway's deadline is the whole call's."""
    slow = recorder({"GET /tickets": answer})
    configure(settings, "ticket.reference", slow.url, "k3y-value")
    started = time.monotonic()
    with pytest.raises(gateway_errors.CallTimedOut):
        http_request("ticket.reference", "GET", f"{slow.url}/tickets", timeout=0.6)
    took = time.monotonic() - started
    assert 0.5 < took < 1.5, took
    _, outcome = use("ticket.reference", slow.url)  # the connector's own deadline: 5 s
    assert isinstance(outcome, errors.OutcomeUnknown)
    rows = list(GatewayCall.objects.filter(port=slow.server_address[1]).order_by("at"))
    assert [r.outcome for r in rows] == ["timeout"] * 2
    assert rows[0].duration_ms < 1500


def test_keep_alive_connections_are_reused_under_the_gateway(settings, recorder):
    """The ticket systems' pooled, kept-alive connections stay (the dispatcher's throughput)."""
    server = recorder(ANSWERS)
    configure(settings, "ticket.reference", server.url, "k3y-value")
    for _ in range(5):
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5, keep_alive=True)
    assert len(server.seen) == 5
    assert len({r["client_port"] for r in server.seen}) == 1, "one connection, kept alive"
    for _ in range(3):
        http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5, keep_alive=False)
    assert len({r["client_port"] for r in server.seen[5:]}) == 3, "a connection per request"
    assert GatewayCall.objects.filter(port=server.server_address[1], outcome="ok").count() == 8


def test_an_answer_echoing_the_credential_reaches_the_caller_redacted(settings, recorder):
    def echo(handler):
        data = json.dumps({"error": "unauthorized", "detail": handler.headers["Authorization"]}).encode()
        handler.send_response(401)
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("X-Echo", handler.headers["Authorization"])
        handler.end_headers()
        handler.wfile.write(data)

    server = recorder({"GET /tickets": echo})
    configure(settings, "ticket.reference", server.url, "echoed-s3cret-value")
    _, outcome = use("ticket.reference", server.url)
    assert isinstance(outcome, errors.Unauthorized)
    assert "echoed-s3cret-value" not in repr(outcome.as_dict()) + repr(outcome.body)
    assert "[redacted]" in repr(outcome.body)
    response = http_request("ticket.reference", "GET", f"{server.url}/tickets", timeout=5)
    assert "echoed-s3cret-value" not in response.text + repr(response.headers)
