"""Structured tool errors (DESIGN.md §6; spec §16.1: parameter error, no permission, precondition
version conflict, temporarily unavailable, definitely not executed, outcome unknown). They are never
flattened into "try again": each class has its own recovery."""

from __future__ import annotations


class ToolError(Exception):
    """Base class. ``retryable``: may the *same* request be sent again (with the same key)?
    ``executed``: True / False / None (unknown) — did the remote effect happen?"""

    code = "tool_error"
    retryable = False
    executed: bool | None = False

    def __init__(self, detail: str = "", *, status: int | None = None, body: dict | None = None):
        super().__init__(detail or self.code)
        self.detail = detail or self.code
        self.status = status
        self.body = body or {}

    def as_dict(self) -> dict:
        return {"class": type(self).__name__, "code": self.code, "detail": self.detail, "status": self.status}


class InvalidParams(ToolError):
    code = "invalid_params"


class Unauthorized(ToolError):
    code = "unauthorized"


class PreconditionFailed(ToolError):
    """A version conflict (412) or a stale fencing token (409): re-read and re-plan."""

    code = "precondition_failed"


class TemporarilyUnavailable(ToolError):
    """The remote refused before doing anything (503/429): retry later with the same key."""

    code = "temporarily_unavailable"
    retryable = True


class DefinitelyNotExecuted(ToolError):
    """The request never reached the remote (connect refused, DNS): nothing happened."""

    code = "definitely_not_executed"
    retryable = True


class OutcomeUnknown(ToolError):
    """Sent, but no answer (timeout, dropped connection, 5xx after sending): look up by key."""

    code = "outcome_unknown"
    executed = None
