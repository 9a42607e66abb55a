"""Domain errors (DESIGN.md §1: bad input gets a clear error, never a 500): what a service raises
for a caller's mistake or a lost race. Each carries the HTTP status the API answers with and a
stable machine-readable code; the API layer's exception handler (:mod:`apps.accounts.api`) turns
them into ``{"error": code, "detail": ...}`` responses, and pages show ``detail``. No DRF here, so
services raise them without importing the API framework."""

from __future__ import annotations


class DomainError(Exception):
    """Base of errors a service raises for a caller's mistake or a lost race.

    ``http_status`` is the status the API answers with; ``code`` a stable machine-readable code.
    """

    http_status = 400
    code = "bad_request"

    def __init__(self, detail: str, **extra):
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class Conflict(DomainError):
    http_status = 409
    code = "conflict"


class Unprocessable(DomainError):
    http_status = 422
    code = "unprocessable"


class NotFound(DomainError):
    http_status = 404
    code = "not_found"


class Forbidden(DomainError):
    http_status = 403
    code = "forbidden"


class Unavailable(DomainError):
    """A system the decision depends on (e.g. the ticket system) cannot be asked right now."""

    http_status = 503
    code = "unavailable"


class QuotaExceeded(DomainError):
    """The tenant has used its quota (open requests, or today's cost units or tokens)."""

    http_status = 429
    code = "quota_exceeded"
