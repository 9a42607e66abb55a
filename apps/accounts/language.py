"""The language each person sees (issue: two languages, chosen per user): pages, form errors,
messages, API error details and the answers composed for them.

Order of precedence, first that applies:

1. the signed-in user's saved choice (:class:`~apps.accounts.models.LanguagePreference`), copied
   into the session at sign-in and whenever it is changed — so no request reads it from the
   database;
2. the language cookie (``settings.LANGUAGE_COOKIE_NAME``), set by the chooser for anyone,
   signed in or not;
3. the browser's ``Accept-Language``;
4. ``settings.LANGUAGE_CODE`` (English).

Django's ``LocaleMiddleware`` applies 2–4; :class:`UserLanguageMiddleware`, placed after the
authentication middleware, applies 1."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.contrib.auth.signals import user_logged_in
from django.core import checks
from django.dispatch import receiver
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.utils import translation
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _

#: the session key holding the signed-in user's saved language
SESSION_KEY = "faultdesk_language"


def supported(code: object) -> str | None:
    """``code`` as one of ``settings.LANGUAGES``' codes (case-insensitive, ``_`` read as ``-``),
    or None when it is not one of them."""
    if not isinstance(code, str):
        return None
    code = code.strip().lower().replace("_", "-")
    return code if code in dict(settings.LANGUAGES) else None


class UserLanguageMiddleware:
    """Activate the signed-in user's saved language for this request (see the module's order of
    precedence). Reads the session only; a session without a saved language changes nothing."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        session = getattr(request, "session", None)
        code = supported(session.get(SESSION_KEY)) if session is not None else None
        if code is not None and getattr(request, "user", None) is not None and request.user.is_authenticated:
            translation.activate(code)
            request.LANGUAGE_CODE = code
        return self.get_response(request)


def saved_language(user) -> str | None:
    """``user``'s saved language (one of ``settings.LANGUAGES``), or None. One query."""
    from apps.accounts.models import LanguagePreference

    return supported(LanguagePreference.objects.filter(user=user).values_list("language", flat=True).first())


def language_activate_saved(user, request: HttpRequest | None) -> str | None:
    """Activate ``user``'s saved language for the rest of this request (for a request signed in
    without a session, e.g. HTTP Basic on the API); returns it, or None when the user saved none
    (the cookie or Accept-Language then stands). One query."""
    code = saved_language(user)
    if code is not None:
        translation.activate(code)
        if request is not None:
            request.LANGUAGE_CODE = code
    return code


@receiver(user_logged_in, dispatch_uid="accounts.language_at_sign_in")
def language_at_sign_in(sender, request, user, **kwargs) -> None:
    """Copy ``user``'s saved language into the new session (one read, at sign-in only)."""
    if request is None or getattr(request, "session", None) is None:
        return
    code = saved_language(user)
    if code is not None:
        request.session[SESSION_KEY] = code


def language_set(request: HttpRequest) -> HttpResponse:
    """``POST /language/`` with ``language`` (a code of ``settings.LANGUAGES``) and an optional
    ``next`` (a path on this site): remember the choice — in the signed-in user's preference and
    session, and in the language cookie for anyone — and go back to ``next`` (else the home page).

    An unknown language is a 400 that changes nothing; a ``next`` pointing off this site is
    ignored (the home page instead), so the chooser cannot be used as an open redirect."""
    from apps.accounts.models import LanguagePreference

    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"], content=_("Choose a language with the chooser on any page."),
                                      content_type="text/plain; charset=utf-8")
    code = supported(request.POST.get("language"))
    if code is None:
        choices = ", ".join(c for c, _name in settings.LANGUAGES)
        return HttpResponseBadRequest(_("Unknown language. Choose one of: %(choices)s.") % {"choices": choices},
                                      content_type="text/plain; charset=utf-8")
    target = request.POST.get("next") or request.META.get("HTTP_REFERER") or "/"
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
        target = "/"
    if request.user.is_authenticated:
        LanguagePreference.objects.update_or_create(user=request.user, defaults={"language": code})
        request.session[SESSION_KEY] = code
    translation.activate(code)
    response = HttpResponseRedirect(target)
    response.set_cookie(settings.LANGUAGE_COOKIE_NAME, code, max_age=settings.LANGUAGE_COOKIE_AGE or 365 * 86400,
                        path=settings.LANGUAGE_COOKIE_PATH, domain=settings.LANGUAGE_COOKIE_DOMAIN,
                        secure=settings.LANGUAGE_COOKIE_SECURE or request.is_secure(),
                        httponly=settings.LANGUAGE_COOKIE_HTTPONLY, samesite=settings.LANGUAGE_COOKIE_SAMESITE or "Lax")
    return response


@checks.register(checks.Tags.translation)
def catalogues_compiled(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """``faultdesk.W101``: a translation catalogue (``LOCALE_PATHS``) whose compiled ``.mo`` is
    missing or older than its ``.po`` — its language would show English, or yesterday's words.
    The install step compiles them (``python -m tools.i18n compile``); an image build must too."""
    problems = []
    for root in settings.LOCALE_PATHS:
        for po in sorted(Path(root).glob("*/LC_MESSAGES/*.po")):
            mo = po.with_suffix(".mo")
            if not mo.exists() or mo.stat().st_mtime < po.stat().st_mtime:
                problems.append(checks.Warning(
                    f"the translation catalogue {po} is not compiled (or its .mo is older than the .po)",
                    hint="run `python -m tools.i18n compile` (make install does)", id="faultdesk.W101"))
    return problems
