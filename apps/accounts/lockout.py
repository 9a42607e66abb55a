"""The answer to a sign-in refused because of too many failures (django-axes'
``AXES_LOCKOUT_CALLABLE``): 429 with ``Retry-After``; JSON under ``/api/`` (HTTP Basic), the
login page with the reason elsewhere. The right password does not get through during the
cool-off."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.translation import gettext as _
from drf_spectacular.authentication import BasicScheme
from rest_framework.authentication import BasicAuthentication
from rest_framework.exceptions import AuthenticationFailed

from apps.accounts.language import language_activate_saved


def lockout_response(request: HttpRequest, original_response=None, credentials: dict | None = None) -> HttpResponse:
    """A 429 for ``request`` whose sign-in is locked out (``credentials`` as axes passes them)."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    detail = _("too many failed sign-ins for this account from this address; try again in %(minutes)s minutes") % {
        "minutes": minutes}
    if request.path.startswith("/api/"):
        response: HttpResponse = JsonResponse({"error": "locked_out", "detail": detail}, status=429)
    else:
        form = AuthenticationForm(request)
        form.errors["__all__"] = form.error_class([detail])
        response = render(request, "registration/login.html", {"form": form, "locked_out": True}, status=429)
    response["Retry-After"] = str(int(settings.AXES_COOLOFF_TIME.total_seconds()))
    return response


#: Longest username anyone can have (Django's ``User.username``).
MAX_USERNAME = 150


def lockout_username(request: HttpRequest, credentials: dict | None) -> str | None:
    """The username django-axes records and locks (``AXES_USERNAME_CALLABLE``): what was sent,
    without NUL characters and cut to :data:`MAX_USERNAME` — its own table cannot store more, and
    a longer name belongs to nobody."""
    name = (credentials or {}).get("username")
    if name is None and request is not None:
        name = request.POST.get("username")
    if not isinstance(name, str):
        return name
    return name.replace("\x00", "")[:MAX_USERNAME]


def client_ip(request: HttpRequest) -> str:
    """The client's address for lockouts (``AXES_CLIENT_IP_CALLABLE``), as DRF's throttles see it:
    the peer's address, or behind ``NUM_PROXIES`` trusted proxies the address the outermost of
    them saw in ``X-Forwarded-For`` — never a value the client itself put there."""
    proxies = settings.REST_FRAMEWORK.get("NUM_PROXIES") or 0
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if proxies and forwarded:
        addresses = [a.strip() for a in forwarded.split(",") if a.strip()]
        if addresses:
            return addresses[-min(proxies, len(addresses))]
    return request.META.get("REMOTE_ADDR", "")


class LockoutAwareBasicAuthentication(BasicAuthentication):
    """DRF's HTTP Basic, authenticating against the underlying Django request, so that
    django-axes counts the failure and its middleware sees a lockout (DRF's own ``Request``
    wrapper would keep the lockout mark to itself and answer a plain 403). A username or password
    with a NUL, or a username longer than anyone's, is refused before any lookup."""

    def authenticate_credentials(self, userid, password, request=None):
        if "\x00" in userid or "\x00" in password or len(userid) > MAX_USERNAME:
            raise AuthenticationFailed(_("Invalid username/password."))
        user, auth = super().authenticate_credentials(userid, password, getattr(request, "_request", request))
        # A request signed in by HTTP Basic has no session to carry the user's saved language
        # (apps/accounts/language.py): read it now, so the answer speaks the user's language.
        language_activate_saved(user, getattr(request, "_request", request))
        return user, auth


class LockoutAwareBasicScheme(BasicScheme):
    """The OpenAPI description of :class:`LockoutAwareBasicAuthentication`: HTTP Basic."""

    target_class = "apps.accounts.lockout.LockoutAwareBasicAuthentication"
