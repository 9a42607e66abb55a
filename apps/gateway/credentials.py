"""The credentials the gateway injects (spec agent-execution-system.md §16.6: "凭证由网关注入而非放进模型
上下文"; ADR 0022). This module is the only place in ``apps/`` that reads them: no connector,
provider or sender is ever handed one (``tests/test_credentials_stay_in_the_gateway.py`` checks the
source). Each is read at call time from the settings — its value, or the file its ``*_FILE`` setting
names (a mounted secret; :func:`config.secrets.secret_value`).
"""

from __future__ import annotations

from urllib.parse import unquote

from django.conf import settings

from apps.gateway import tools
from config.secrets import secret_value

#: tool -> (setting holding the value, setting holding a file path, where: FAULTDESK or the top level,
#: the scheme of the Authorization header)
_SOURCES = {
    tools.TICKET_REFERENCE: ("REFSERVICE_API_KEY", "REFSERVICE_API_KEY_FILE", "FAULTDESK", "Bearer"),
    tools.TICKET_HELPDESK: ("HELPDESK_API_TOKEN", "HELPDESK_API_TOKEN_FILE", "FAULTDESK", "Token"),
    tools.MODEL: ("MODEL_API_KEY", "MODEL_API_KEY_FILE", "FAULTDESK", "Bearer"),
    tools.EMBEDDINGS: ("EMBEDDING_API_KEY", "EMBEDDING_API_KEY_FILE", "FAULTDESK", "Bearer"),
    tools.SMTP: ("EMAIL_HOST_PASSWORD", "EMAIL_HOST_PASSWORD_FILE", "settings", None),
    # the OTLP headers (``k=v,k2=v2``, values percent-encoded as the OTLP exporter spec has them)
    tools.TELEMETRY: ("OTLP_HEADERS", "OTLP_HEADERS_FILE", "FAULTDESK", "headers"),
}


def secret(tool: str) -> str:
    """The secret of ``tool`` (empty when none is configured). Raises ``KeyError`` for an unknown
    tool, ``OSError`` when its ``*_FILE`` names a file that cannot be read."""
    value_name, file_name, where, _scheme = _SOURCES[tool]
    if where == "FAULTDESK":
        conf = settings.FAULTDESK
        return secret_value(conf.get(value_name, ""), conf.get(file_name, ""))
    return secret_value(getattr(settings, value_name, ""), getattr(settings, file_name, ""))


def authorization(tool: str) -> dict[str, str]:
    """The header that carries ``tool``'s credential (``{"Authorization": "Bearer …"}``), or ``{}``
    when it has none configured. Raises as :func:`secret`."""
    scheme = _SOURCES[tool][3]
    value = secret(tool)
    if scheme == "headers":
        return _headers_of(value)
    return {"Authorization": f"{scheme} {value}"} if value and scheme else {}


def _headers_of(value: str) -> dict[str, str]:
    """The headers of an OTLP headers setting ``k=v,k2=v2`` (values percent-decoded; an entry
    without ``=`` is skipped)."""
    found = {}
    for item in value.split(","):
        name, eq, val = item.partition("=")
        if eq and name.strip():
            found[unquote(name.strip())] = unquote(val.strip())
    return found


def secret_parts(headers: dict[str, str]) -> list[str]:
    """The secret parts of injected ``headers`` (the token of an ``Authorization`` header, the value
    of any other; empty values left out), for redaction."""
    return [v.partition(" ")[2] if k.lower() == "authorization" and " " in v else v for k, v in headers.items() if v]


def secret_values(tool: str) -> list[str]:
    """:func:`secret_parts` of what :func:`authorization` injects for ``tool``. Raises as :func:`secret`."""
    return secret_parts(authorization(tool))


def smtp_login() -> tuple[str, str]:
    """``(user, password)`` for the SMTP relay's ``AUTH`` (``EMAIL_HOST_USER`` and
    ``EMAIL_HOST_PASSWORD`` or ``EMAIL_HOST_PASSWORD_FILE``); empty strings: no login."""
    return getattr(settings, "EMAIL_HOST_USER", "") or "", secret(tools.SMTP)
