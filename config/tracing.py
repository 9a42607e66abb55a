"""OpenTelemetry spans: a span for every web request, every Celery task and every outbound HTTP call
(ticket systems, the model endpoint), exported over OTLP/HTTP through the tool gateway (tool
``telemetry``: apps/gateway/telemetry.py) — only when an endpoint is configured
(``OTEL_EXPORTER_OTLP_ENDPOINT``, or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). With none, nothing is
instrumented and nothing is exported: tracing costs nothing by default.

The web process calls :func:`setup_tracing` from ``config/wsgi.py``; each Celery worker process
calls it on ``worker_process_init`` (after the fork, as the SDK requires). The service name is
``OTEL_SERVICE_NAME`` or ``faultdesk-<role>``.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_DONE = False
_PROVIDER = None


def endpoint_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


#: request and response headers never copied onto a span, whatever the capture settings ask
#: (``OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_*``): a signed-in user's basic auth, session cookies
_SANITIZED = ("authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", ".*token.*",
              ".*secret.*", ".*password.*", ".*key.*")


def provider():
    """The tracer provider spans go to (the gateway starts its own client spans on it), or None when
    tracing is off."""
    return _PROVIDER


def setup_tracing(role: str, *, exporter=None) -> bool:
    """Instrument Django and Celery and export their spans and the tool gateway's (one client span per
    outbound call, made by the gateway itself with no header, body or error text on it: the httpx
    instrumentation is not used, as it would record the raw exceptions and captured headers of
    requests that carry a credential). ``exporter``: a span exporter to use instead of OTLP (tests
    pass an in-memory one). Returns True when tracing is on; False (and does nothing) without an
    exporter or a configured endpoint. Idempotent per process."""
    global _DONE, _PROVIDER
    if _DONE:
        return True
    if exporter is None and not endpoint_configured():
        return False
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"faultdesk-{role}"}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        from apps.gateway.telemetry import export_session

        # through the tool gateway, as every outbound call (tool ``telemetry``, ADR 0022)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(session=export_session())))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if exporter is None:
        trace.set_tracer_provider(provider)  # once per process; tests pass their provider explicitly
    asked = os.environ.get("OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS", "")
    os.environ["OTEL_INSTRUMENTATION_HTTP_CAPTURE_HEADERS_SANITIZE_FIELDS"] = ",".join(
        [f for f in asked.split(",") if f.strip()] + list(_SANITIZED))
    DjangoInstrumentor().instrument(tracer_provider=provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)
    _PROVIDER = provider
    _DONE = True
    log.info("tracing on: spans of %s exported", role)
    return True


def teardown_tracing() -> None:
    """Undo :func:`setup_tracing` (tests)."""
    global _DONE, _PROVIDER
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.django import DjangoInstrumentor

    for inst in (DjangoInstrumentor(), CeleryInstrumentor()):
        if inst.is_instrumented_by_opentelemetry:
            inst.uninstrument()
    _DONE = False
    _PROVIDER = None
