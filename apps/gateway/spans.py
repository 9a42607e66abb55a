"""The tool gateway's client span per outbound call (ADR 0022), when tracing is on
(``config.tracing``).

The gateway makes its own span instead of instrumenting httpx: the instrumentation would copy the
raw exception (an HTTP parser's message may quote a line echoing the credential) and, with the
capture settings, the request headers (the injected ``Authorization``) onto a span that is exported
to a collector. This span holds only what a ``GatewayCall`` record holds: the tool, the method, the
destination and path (never the query), the outcome class and the status. Span export itself
(tool ``telemetry``) makes no span.
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from apps.gateway import tools
from apps.gateway.destinations import Destination
from config import tracing


def start(tool: str, method: str, dest: Destination, path: str):
    """A started CLIENT span for one call, or None when tracing is off (or for span export)."""
    provider = tracing.provider()
    if provider is None or tool == tools.TELEMETRY:
        return None
    return provider.get_tracer("faultdesk.gateway").start_span(
        method.upper(), kind=SpanKind.CLIENT,
        attributes={"http.request.method": method.upper(), "server.address": dest.host, "server.port": dest.port,
                    "url.full": f"{dest.scheme}://{dest.host}:{dest.port}{path}", "url.path": path,
                    "faultdesk.tool": tool})


def propagation_headers(span) -> dict[str, str]:
    """The ``traceparent`` (and ``tracestate``) headers that continue ``span`` at the server; ``{}``
    without a span."""
    if span is None:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def end(span, outcome: str, status: int | None) -> None:
    """End ``span`` (None: nothing) with the call's outcome class and HTTP status; any outcome but
    ``ok`` and ``redirect`` marks it an error, described by the outcome class alone."""
    if span is None:
        return
    span.set_attribute("faultdesk.outcome", outcome)
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if outcome not in ("ok", "redirect"):
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()
