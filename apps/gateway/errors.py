"""What the tool gateway raises when a call does not end with an answer (ADR 0022).

Each class says whether the request may have left the process (``sent``: False — certainly not;
None — perhaps; True — it did). The callers map them to the tool error taxonomy
(:mod:`apps.core.tool_errors`): nothing sent is ``DefinitelyNotExecuted``, perhaps sent is
``OutcomeUnknown``. A refused destination is never "perhaps": no socket was opened.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base class: ``tool`` (e.g. ``ticket.reference``), ``outcome`` (the recorded outcome class),
    ``sent`` (see the module)."""

    outcome = "transport_error"
    sent: bool | None = None

    def __init__(self, tool: str, detail: str, *, status: int | None = None):
        super().__init__(f"{tool}: {detail}")
        self.tool = tool
        self.detail = detail
        self.status = status


class DestinationRefused(GatewayError):
    """The destination (scheme, host, port) is not one the tool may reach: refused before any
    socket was opened (spec §16.6: a tool reaches only what its scope allows)."""

    outcome = "refused_destination"
    sent = False


class ConnectFailed(GatewayError):
    """No connection could be made (refused, unreachable, DNS, connect timeout): nothing was sent."""

    outcome = "connect_error"
    sent = False


class CallTimedOut(GatewayError):
    """The call's whole deadline passed before a complete answer: the request may have been
    handled."""

    outcome = "timeout"
    sent = None


class TransportFailed(GatewayError):
    """The connection broke after the request was (perhaps) sent: a dropped connection, a protocol
    error. The request may have been handled."""

    outcome = "transport_error"
    sent = None


class ResponseTooLarge(GatewayError):
    """The answer is larger than the tool's cap: it was cut at the cap and not read further. The
    request was handled (``status`` is the answer's HTTP status); what it said is unknown."""

    outcome = "too_large"
    sent = True
