"""Span export goes through the tool gateway as tool ``telemetry`` (ADR 0022): only the OTLP traces
endpoint is reached, with the headers the gateway injects, never an environment proxy, ``.netrc`` or a
header the exporter read from the environment itself; each export is recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

from apps.gateway.models import GatewayCall
from apps.gateway.telemetry import export_session
from apps.gateway.tests.servers import CountingListener, Recorder

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[3]
OK = (200, {"Content-Type": "application/x-protobuf"}, b"")


@pytest.fixture
def collector():
    server = Recorder({"POST /v1/traces": OK})
    yield server
    server.close()


@pytest.fixture
def proxy(monkeypatch, tmp_path):
    """A proxy in the environment and a ``.netrc`` holding a password for loopback: neither may be used."""
    listener = CountingListener()
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, listener.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine 127.0.0.1 login someone password netrc-LEAK\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    yield listener
    listener.close()


def _export_one(endpoint: str, timeout: float = 5.0) -> SpanExportResult:
    exporter = OTLPSpanExporter(endpoint=endpoint, session=export_session(), timeout=timeout)
    results = []

    class Keep(SimpleSpanProcessor):
        def on_end(self, span):
            results.append(self.span_exporter.export((span,)))

    provider = TracerProvider()
    provider.add_span_processor(Keep(exporter))
    with provider.get_tracer("gateway-test").start_as_current_span("probe"):
        pass
    return results[0]


def test_spans_reach_the_endpoint_through_the_gateway_with_its_headers_only(settings, monkeypatch, collector,
                                                                             proxy):
    endpoint = f"{collector.url}/v1/traces"
    settings.FAULTDESK = {**settings.FAULTDESK, "OTLP_TRACES_ENDPOINT": endpoint,
                          "OTLP_HEADERS": "x-api-key=tele%2Fkey-1", "OTLP_HEADERS_FILE": ""}
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-env-key=read-by-the-exporter")

    assert _export_one(endpoint) == SpanExportResult.SUCCESS

    (seen,) = collector.seen
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert (seen["method"], seen["path"]) == ("POST", "/v1/traces")
    assert headers["x-api-key"] == "tele/key-1"  # injected by the gateway, percent-decoded
    assert "x-env-key" not in headers and "authorization" not in headers
    assert headers["content-type"] == "application/x-protobuf"
    assert proxy.accepts == 0
    row = GatewayCall.objects.get(tool="telemetry")
    assert (row.outcome, row.method, row.path, row.http_status) == ("ok", "POST", "/v1/traces", 200)


def test_an_export_to_anywhere_but_the_configured_endpoint_is_refused_before_a_socket(settings, collector):
    elsewhere = CountingListener()
    try:
        settings.FAULTDESK = {**settings.FAULTDESK, "OTLP_TRACES_ENDPOINT": f"{collector.url}/v1/traces",
                              "OTLP_HEADERS": "x-api-key=k", "OTLP_HEADERS_FILE": ""}
        assert _export_one(f"{elsewhere.url}/v1/traces", timeout=1.0) == SpanExportResult.FAILURE
        assert elsewhere.accepts == 0
        assert collector.seen == []
        assert GatewayCall.objects.filter(tool="telemetry", outcome="refused_destination").exists()
    finally:
        elsewhere.close()


def test_tracing_set_up_from_the_environment_exports_through_the_gateway(collector, tmp_path):
    """``config.tracing.setup_tracing`` as a process starts it, with the endpoint and headers in the
    environment and a proxy there too: the spans reach the endpoint with the headers, not the proxy."""
    proxy = CountingListener()
    try:
        script = textwrap.dedent("""
            import django, os
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.test")
            django.setup()
            from opentelemetry import trace
            from config.tracing import setup_tracing
            assert setup_tracing("web")
            with trace.get_tracer("gateway-test").start_as_current_span("probe"):
                pass
            assert trace.get_tracer_provider().force_flush(10000)
        """)
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "5",
               "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=from-the-environment", "HTTP_PROXY": proxy.url,
               "http_proxy": proxy.url, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, timeout=120, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert [(s["method"], s["path"]) for s in collector.seen] == [("POST", "/v1/traces")]
        headers = {k.lower(): v for k, v in collector.seen[0]["headers"].items()}
        assert headers["x-api-key"] == "from-the-environment"
        assert proxy.accepts == 0
    finally:
        proxy.close()
