"""The tool gateway's part of the settings (``FAULTDESK["GATEWAY_*"]``; apps/gateway, ADR 0022): which
destinations each tool may reach beyond its configured base URL, how much of an answer the gateway
reads, and how long one SMTP step may take."""

from __future__ import annotations


def _otlp_traces_endpoint(env) -> str:
    """The URL spans are exported to, as the OTLP exporter resolves it: the traces endpoint, or
    ``/v1/traces`` under the base endpoint; empty when neither is set (no export)."""
    traces = env.str("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", default="")
    if traces:
        return traces
    base = env.str("OTEL_EXPORTER_OTLP_ENDPOINT", default="")
    return f"{base.removesuffix('/')}/v1/traces" if base else ""


def gateway_settings(env) -> dict:
    """The ``FAULTDESK`` entries of the tool gateway, read from the environment with ``env``
    (django-environ's ``Env``): ``GATEWAY_ALLOW`` ({tool: [URL, ...]}), the answer caps (bytes) and
    the SMTP reply cap (bytes) and deadline (seconds)."""
    return {
        # The tool gateway (apps/gateway, ADR 0022): each tool reaches its configured base URL's destination
        # (scheme, host, port) and those of the URLs listed here, nothing else (a fault proxy in front of a
        # ticket system, a model server a pinned task still uses).
        "GATEWAY_ALLOW": {
            "ticket.reference": env.list("FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE", default=[]),
            "ticket.helpdesk": env.list("FAULTDESK_GATEWAY_ALLOW_TICKET_HELPDESK", default=[]),
            "model": env.list("FAULTDESK_GATEWAY_ALLOW_MODEL", default=[]),
            "embeddings": env.list("FAULTDESK_GATEWAY_ALLOW_EMBEDDINGS", default=[]),
            "notifications.smtp": env.list("FAULTDESK_GATEWAY_ALLOW_NOTIFICATIONS_SMTP", default=[]),
            "telemetry": env.list("FAULTDESK_GATEWAY_ALLOW_TELEMETRY", default=[]),
        },
        # span export (config/tracing.py) is a tool of the gateway too: its destination is the OTLP traces
        # endpoint, its credential the OTLP headers (``k=v,k2=v2``, e.g. an API key header of a hosted
        # collector) the gateway injects — the exporter's own reading of them is never sent
        "OTLP_TRACES_ENDPOINT": _otlp_traces_endpoint(env),
        "OTLP_HEADERS": env.str("OTEL_EXPORTER_OTLP_TRACES_HEADERS", default="")
        or env.str("OTEL_EXPORTER_OTLP_HEADERS", default=""),
        "OTLP_HEADERS_FILE": env.str("FAULTDESK_OTLP_HEADERS_FILE", default=""),
        "GATEWAY_TELEMETRY_MAX_RESPONSE_BYTES": env.int("FAULTDESK_GATEWAY_TELEMETRY_MAX_RESPONSE_BYTES",
                                                        default=64 * 2**10),
        # the most of an answer the gateway reads (bytes; past it the call is "too_large"): a ticket system's
        # (a batch of 50 tickets is ~100 KB), the remote embedding model's; the model's is MODEL_MAX_REPLY_BYTES
        "GATEWAY_TICKET_MAX_RESPONSE_BYTES": env.int("FAULTDESK_GATEWAY_TICKET_MAX_RESPONSE_BYTES", default=4 * 2**20),
        "GATEWAY_EMBEDDINGS_MAX_RESPONSE_BYTES": env.int("FAULTDESK_GATEWAY_EMBEDDINGS_MAX_RESPONSE_BYTES",
                                                         default=32 * 2**20),
        # an SMTP server's reply (bytes), and the deadline of one whole SMTP step (a connect and login, a send)
        "GATEWAY_SMTP_MAX_REPLY_BYTES": env.int("FAULTDESK_GATEWAY_SMTP_MAX_REPLY_BYTES", default=64 * 2**10),
        "GATEWAY_SMTP_DEADLINE_SECONDS": env.float("FAULTDESK_GATEWAY_SMTP_DEADLINE_SECONDS", default=60.0),
    }
