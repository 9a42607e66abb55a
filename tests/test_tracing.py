"""OpenTelemetry spans (``config/tracing.py``): off without an endpoint; with an exporter, a span
for a web request, for a Celery task and for each outbound HTTP call to a ticket system."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from config.tracing import endpoint_configured, setup_tracing, teardown_tracing


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    assert setup_tracing("test", exporter=exporter) is True
    yield exporter
    teardown_tracing()


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert endpoint_configured() is False and setup_tracing("web") is False


def test_requests_celery_tasks_and_outbound_calls_make_spans(spans, client, committed, requester):
    from apps.agent.tasks import agent_step
    from apps.outbox.dispatch import outbox_dispatch_batch

    client.force_login(requester)
    assert client.get("/requests/").status_code == 200
    outbox_dispatch_batch()  # sends the committed ticket.create to the reference service
    agent_step.apply(args=[str(committed.pk)])  # a Celery task, run eagerly
    finished = spans.get_finished_spans()
    kinds = {s.kind.name for s in finished}
    names = [s.name for s in finished]
    assert "SERVER" in kinds and any("requests" in n or n.startswith("GET") for n in names), names
    posts = [s for s in finished if s.kind.name == "CLIENT" and s.attributes.get("http.request.method",
                                                                             s.attributes.get("http.method")) == "POST"]
    assert posts and any("/tickets" in str(s.attributes.get("url.full", s.attributes.get("http.url", "")))
                         for s in posts)
    assert any("agent_step" in n for n in names), names
