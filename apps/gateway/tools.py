"""The tools the gateway knows (ADR 0022): for each, where it may go, which credential it injects and
how, and the cap on what it reads back. Everything is read from settings at call time, so a test or a
reconfigured process sees its own values.

=====================  ==================================  ==========================  ===================
tool                   destinations (besides the list of   credential (``*_FILE``:     answer cap
                       ``FAULTDESK_GATEWAY_ALLOW_<TOOL>``)  a file holding it)          (bytes)
=====================  ==================================  ==========================  ===================
``ticket.reference``   ``REFSERVICE_URL``                  ``REFSERVICE_API_KEY``      ``GATEWAY_TICKET_
                                                           (``Bearer``)                MAX_RESPONSE_BYTES``
``ticket.helpdesk``    ``HELPDESK_URL``                    ``HELPDESK_API_TOKEN``      the same
                                                           (``Token``)
``model``              ``FAULTDESK_MODEL_BASE_URL``        ``FAULTDESK_MODEL_API_KEY`` ``MODEL_MAX_REPLY_
                                                           (``Bearer``)                BYTES``
``embeddings``         the base of ``FAULTDESK_EMBEDDING_  ``FAULTDESK_EMBEDDING_API_  ``GATEWAY_EMBEDDINGS_
                       MODEL`` (``openai:<base>#<name>``)  KEY`` (``Bearer``)          MAX_RESPONSE_BYTES``
``notifications.smtp`` ``EMAIL_HOST``:``EMAIL_PORT``       ``EMAIL_HOST_USER`` +       ``GATEWAY_SMTP_MAX_
                       (``smtps`` with ``EMAIL_USE_SSL``)  ``EMAIL_HOST_PASSWORD``     REPLY_BYTES``
                                                           (SMTP ``AUTH``)
``telemetry``          the OTLP traces endpoint            ``OTEL_EXPORTER_OTLP_       ``GATEWAY_TELEMETRY_
                       (``OTEL_EXPORTER_OTLP_[TRACES_]     [TRACES_]HEADERS``          MAX_RESPONSE_BYTES``
                       ENDPOINT``)                         (``k=v,…``: those headers)
=====================  ==================================  ==========================  ===================
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from apps.gateway.destinations import Destination, destinations_of

TICKET_REFERENCE = "ticket.reference"
TICKET_HELPDESK = "ticket.helpdesk"
MODEL = "model"
EMBEDDINGS = "embeddings"
SMTP = "notifications.smtp"
TELEMETRY = "telemetry"
TOOLS = (TICKET_REFERENCE, TICKET_HELPDESK, MODEL, EMBEDDINGS, SMTP, TELEMETRY)


def _embedding_base() -> str:
    model = settings.FAULTDESK.get("EMBEDDING_MODEL") or ""
    return model[len("openai:"):].partition("#")[0] if model.startswith("openai:") else ""


def _smtp_base() -> str:
    host = getattr(settings, "EMAIL_HOST", "")
    if not host:
        return ""
    scheme = "smtps" if getattr(settings, "EMAIL_USE_SSL", False) else "smtp"
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{int(settings.EMAIL_PORT)}"


def configured_url(tool: str) -> str:
    """The base URL the configuration gives ``tool`` (empty when it has none: no remote embedding
    model, no ``EMAIL_HOST``). Raises ``KeyError`` for an unknown tool."""
    conf = settings.FAULTDESK
    return {
        TICKET_REFERENCE: lambda: conf["REFSERVICE_URL"],
        TICKET_HELPDESK: lambda: conf["HELPDESK_URL"],
        MODEL: lambda: conf["MODEL_BASE_URL"],
        EMBEDDINGS: _embedding_base,
        SMTP: _smtp_base,
        TELEMETRY: lambda: conf.get("OTLP_TRACES_ENDPOINT", ""),
    }[tool]()


def allowed_destinations(tool: str) -> frozenset[Destination]:
    """Every destination ``tool`` may reach: its configured base URL's, and those of the URLs listed
    for it in ``FAULTDESK["GATEWAY_ALLOW"][tool]`` (``FAULTDESK_GATEWAY_ALLOW_<TOOL>``, e.g.
    ``FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE``; a fault proxy in front of a ticket system, a second
    model server a pinned task still uses). Nothing else. Raises ``KeyError`` for an unknown tool,
    ``ValueError`` for a listed URL that cannot be read."""
    extra = settings.FAULTDESK.get("GATEWAY_ALLOW", {}).get(tool, ())
    return destinations_of((configured_url(tool), *extra))


@dataclass(frozen=True)
class Caps:
    """What one call of a tool may take: ``max_bytes`` of answer (cut past it)."""

    max_bytes: int


def caps(tool: str) -> Caps:
    """The caps of ``tool`` (see the module's table). Raises ``KeyError`` for an unknown tool."""
    conf = settings.FAULTDESK
    return Caps(max_bytes=int({
        TICKET_REFERENCE: conf["GATEWAY_TICKET_MAX_RESPONSE_BYTES"],
        TICKET_HELPDESK: conf["GATEWAY_TICKET_MAX_RESPONSE_BYTES"],
        MODEL: conf["MODEL_MAX_REPLY_BYTES"],
        EMBEDDINGS: conf["GATEWAY_EMBEDDINGS_MAX_RESPONSE_BYTES"],
        SMTP: conf["GATEWAY_SMTP_MAX_REPLY_BYTES"],
        TELEMETRY: conf.get("GATEWAY_TELEMETRY_MAX_RESPONSE_BYTES", 64 * 2**10),
    }[tool]))
