"""Shared DRF pieces: the principal permission and the exception handler that turns domain
errors (:mod:`apps.core.errors`) into clear 4xx responses (never a 500 for bad input)."""

from __future__ import annotations

from django.utils.translation import gettext as _
from rest_framework import status
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from apps.accounts.principal import NoMembership, Principal, principal_for_user
from apps.core.errors import DomainError


def request_principal(request) -> Principal:
    """The principal of an authenticated DRF/Django request; 403 when it has no tenant. Resolved
    once per request (the permission check and the view ask for it both) and kept on the request
    for the signed-in user it was resolved for."""
    user = request.user
    cached = getattr(request, "_faultdesk_principal", None)
    if cached is not None and cached[0] is user:
        return cached[1]
    try:
        principal = principal_for_user(user)
    except NoMembership as exc:
        raise PermissionDenied(_("you are not a member of any tenant")) from exc
    request._faultdesk_principal = (user, principal)
    return principal


class HasPrincipal(BasePermission):
    """Authenticated and a member of a tenant."""

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        request_principal(request)
        return True


def exception_handler(exc, context):
    """DRF exception handler: domain errors become ``{"error": code, "detail": ...}``."""
    if isinstance(exc, DomainError):
        body = {"error": exc.code, "detail": exc.detail, **exc.extra}
        response = Response(body, status=exc.http_status)
        if "retry_after" in exc.extra:
            response["Retry-After"] = str(exc.extra["retry_after"])
        return response
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if response.status_code == status.HTTP_500_INTERNAL_SERVER_ERROR:  # pragma: no cover
        response.data = {"error": "internal"}
    elif isinstance(response.data, dict) and set(response.data) == {"detail"}:
        # DRF's own refusals (not signed in, forbidden, throttled, unsupported media…) get the
        # same shape as every other error: {"error": code, "detail": text}.
        code = getattr(response.data["detail"], "code", None) or getattr(exc, "default_code", "error")
        response.data = {"error": str(code), "detail": str(response.data["detail"])}
    return response

