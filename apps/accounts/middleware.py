"""Request hygiene shared by every page and endpoint."""

from __future__ import annotations

import structlog
from django.conf import settings
from django.db import DatabaseError
from django.http import HttpResponse, JsonResponse
from django.utils import translation
from django.utils.html import escape
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from config.database import retryable


def _request_language(request) -> str:
    """The language of ``request``'s answer: the one ``LocaleMiddleware`` (or the signed-in
    user's saved choice) activated for it, or — for an answer given before that middleware ran —
    the one its cookie or ``Accept-Language`` asks for. Never a language left active in this
    thread by an earlier request."""
    return getattr(request, "LANGUAGE_CODE", None) or translation.get_language_from_request(request)


class RejectMalformedRequestsMiddleware:
    """Answer 400 to a request whose ``Content-Length`` is not a non-negative integer: Django
    converts it with ``int()`` when the body is read, which would be a 500 for every view that
    reads one (the webhook, every API write). An API body declared over Django's
    ``DATA_UPLOAD_MAX_MEMORY_SIZE`` gets the API's JSON 413, not Django's HTML 400."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        length = request.META.get("CONTENT_LENGTH")
        if length not in (None, "") and not (isinstance(length, str) and length.isascii() and length.isdigit()):
            # before LocaleMiddleware: the request's own language, not one left in this thread
            with translation.override(_request_language(request)):
                detail = _("Content-Length must be a non-negative integer")
            return JsonResponse({"error": "invalid_input", "detail": detail}, status=400)
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        multipart = request.content_type == "multipart/form-data"  # files: capped by UploadLimitsMiddleware
        if length and limit is not None and int(length) > limit and request.path.startswith("/api/") and not multipart:
            with translation.override(_request_language(request)):
                detail = _("the request body is over %(limit)s bytes") % {"limit": limit}
            return JsonResponse({"error": "too_large", "detail": detail}, status=413)
        return self.get_response(request)


class RejectNulBytesMiddleware:
    """Answer 400 to a request whose headers, query string or form fields contain a NUL character.

    PostgreSQL text cannot hold NUL (``\\x00``): such a value would fail at the first query or
    write with a database error, a 500, possibly after a remote call was already made. Refusing
    it before any view runs keeps "bad input gets a clear error and loses nothing". JSON bodies
    are checked by DRF's ``CharField`` (which rejects NUL) and webhooks by their own parser."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        for name, value in request.META.items():
            if name.startswith("HTTP_") and isinstance(value, str) and "\x00" in value:
                header = name[5:].replace("_", "-").title()
                detail = _("header %(header)s contains a NUL character") % {"header": header}
                return JsonResponse({"error": "invalid_input", "detail": detail}, status=400)
        fields = [request.GET]
        if request.method == "POST" and request.content_type == "application/x-www-form-urlencoded":
            _body = request.body  # read the raw body first, so a view can still read it (webhooks sign it)
            fields.append(request.POST)
        elif request.method == "POST" and request.content_type == "multipart/form-data":
            length = request.META.get("CONTENT_LENGTH") or "0"
            if length.isdigit() and int(length) <= (settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0):
                _body = request.body  # small: kept, so a view may still read it; larger files are streamed
            fields.append(request.POST)
        for data in fields:
            for key, values in data.lists():
                if "\x00" in key or any("\x00" in v for v in values):
                    detail = _("field %(field)s contains a NUL character") % {"field": repr(key.replace(chr(0), ""))}
                    return JsonResponse({"error": "invalid_input", "detail": detail}, status=400)
        return self.get_response(request)


class RequestLogContextMiddleware:
    """Bind a request id, the method and the path to every log line of the request
    (``config.logs``); the tenant and the user are bound when the principal is resolved. First in
    the chain, so every answer carries it, a refusal by a later middleware too. The id comes from
    an ``X-Request-ID`` header (at most 64 safe characters) or is new, and is echoed back."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        import re
        import uuid

        from config.logs import bind, clear

        clear()
        given = request.headers.get("X-Request-ID", "")
        request_id = given if re.fullmatch(r"[A-Za-z0-9._-]{1,64}", given) else uuid.uuid4().hex
        bind(request_id=request_id, method=request.method, path=request.path[:200])
        response = self.get_response(request)
        response["X-Request-ID"] = request_id
        clear()
        return response


#: Error codes of the API's JSON errors by HTTP status, for answers Django gives before (or
#: beside) DRF: an unknown route or a malformed id (404), a method not allowed (405), a body over
#: the size limit (400/413), a CSRF refusal (403).
_API_ERROR_CODES = {400: "invalid_input", 401: "not_authenticated", 403: "forbidden", 404: "not_found",
                    405: "method_not_allowed", 413: "too_large", 429: "throttled"}


#: HTTP's reason phrases of those statuses, said in the request's language when an answer carries one.
_API_ERROR_REASONS = {gettext_noop("Bad Request"), gettext_noop("Unauthorized"), gettext_noop("Forbidden"),
                      gettext_noop("Method Not Allowed"), gettext_noop("Request Entity Too Large"),
                      gettext_noop("Too Many Requests")}


class ApiJsonErrorsMiddleware:
    """Every error under ``/api/`` is JSON (README "Errors are JSON 4xx"): an HTML error page
    that Django itself answered (a route that does not match, e.g. ``/api/tasks/not-a-uuid/``, or a
    refusal before any view) is replaced by ``{"error": code, "detail": reason}`` with the same
    status and its ``Allow``/``Retry-After``/``WWW-Authenticate`` headers kept — and its
    ``Content-Language``/``Vary``: the reason is said in the request's language."""

    KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate", "Content-Language", "Vary")

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if not request.path.startswith("/api/") or response.status_code < 400:
            return response
        if response.get("Content-Type", "").split(";")[0].strip().endswith("json"):
            return response
        code = _API_ERROR_CODES.get(response.status_code, "server_error" if response.status_code >= 500 else "error")
        with translation.override(_request_language(request)):
            if response.status_code == 404:
                detail = _("no such resource: %(path)s") % {"path": request.path[:200]}
            elif response.reason_phrase in _API_ERROR_REASONS:
                detail = _(response.reason_phrase)
            else:
                detail = response.reason_phrase or code.replace("_", " ")
        replaced = JsonResponse({"error": code, "detail": detail}, status=response.status_code)
        for header in self.KEPT_HEADERS:
            if header in response:
                replaced[header] = response[header]
        return replaced


#: seconds a client is told to wait after the database refused a request for now
BUSY_RETRY_AFTER_SECONDS = 1


class DatabaseBusyMiddleware:
    """A request the database refused for now — a lock it waited on past ``lock_timeout`` (a
    cancel queued behind a run that holds the task, or behind a request's last re-authorization),
    a statement past ``statement_timeout``, a deadlock or a serialization failure
    (:func:`config.database.retryable`) — is answered ``503`` with ``Retry-After``, not a 500: its
    transaction rolled back whole, so nothing of it was kept and the same request can simply be
    sent again. JSON ``{"error": "busy", …}`` under ``/api/``, a short page elsewhere. Any other
    exception is left to Django."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exc):
        # Only an exception that is itself the refusal (its own or its explicit cause's SQLSTATE):
        # a real failure raised while a lock timeout was being handled must stay a failure.
        refusal = retryable(exc, context=False) if isinstance(exc, DatabaseError) else None
        if refusal is None:
            return None
        structlog.get_logger("faultdesk.web").warning("request.refused_for_now", path=request.path[:200],
                                                      refusal=refusal)
        if request.path.startswith("/api/"):
            detail = _("the database is busy with this record right now; nothing was changed — try again shortly")
            response = JsonResponse({"error": "busy", "detail": detail}, status=503)
        else:
            title = _("Busy")
            text = _("The database is busy with this record right now; nothing was changed — try again shortly.")
            response = HttpResponse(f"<!doctype html><title>{escape(title)}</title><p>{escape(text)}</p>",
                                    status=503, content_type="text/html; charset=utf-8")
        response["Retry-After"] = str(BUSY_RETRY_AFTER_SECONDS)
        return response
