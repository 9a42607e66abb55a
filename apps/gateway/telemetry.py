"""Span export through the tool gateway (ADR 0022): the OTLP/HTTP exporter's ``requests`` session,
with every request it makes sent by :func:`apps.gateway.http.http_request` as tool ``telemetry``.

So span export obeys the rules every other outbound call does: only the OTLP traces endpoint (and
``FAULTDESK_GATEWAY_ALLOW_TELEMETRY``) may be reached; no environment proxy, no ``.netrc``; the
credential (the OTLP headers) is injected by the gateway, and any header the exporter read from the
environment itself is dropped, never sent; the answer is capped; each export is recorded.
"""

from __future__ import annotations

import requests
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict

from apps.gateway import tools
from apps.gateway.errors import GatewayError

#: the request headers of the exporter that are passed on; any other (an API key it read from
#: ``OTEL_EXPORTER_OTLP_HEADERS``) is the gateway's to inject
_PASSED = frozenset({"content-type", "content-encoding", "user-agent"})
_DEFAULT_TIMEOUT = 10.0


class GatewayAdapter(BaseAdapter):
    """A ``requests`` adapter sending each request through the gateway as tool ``telemetry``. A call
    the gateway ends without an answer raises ``requests.ConnectionError`` (the exporter retries it
    within its own deadline)."""

    def send(self, request, stream=False, timeout=None, verify=True, cert=None, proxies=None):
        from apps.gateway.http import http_request  # its record needs the app registry, ready by the first export

        if isinstance(timeout, tuple):
            timeout = sum(t for t in timeout if t) or None
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED}
        try:
            answer = http_request(tools.TELEMETRY, request.method, request.url,
                                  timeout=float(timeout or _DEFAULT_TIMEOUT), headers=headers, content=request.body)
        except GatewayError as exc:
            raise requests.ConnectionError(str(exc), request=request) from None
        response = requests.Response()
        response.status_code = answer.status_code
        response.reason = answer.reason_phrase
        response.headers = CaseInsensitiveDict(answer.headers)
        response._content = answer.content
        response.url = request.url
        response.request = request
        response.encoding = answer.encoding
        return response

    def close(self) -> None:
        """Nothing to release: the gateway owns the connections."""


def export_session() -> requests.Session:
    """A ``requests.Session`` for the OTLP exporter (``OTLPSpanExporter(session=…)``) whose every
    request goes through the gateway; it never reads the environment (proxies, ``.netrc``)."""
    session = requests.Session()
    session.trust_env = False
    for prefix in ("http://", "https://"):
        session.mount(prefix, GatewayAdapter())
    return session
