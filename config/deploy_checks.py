"""Deploy system checks: production fails closed (``manage.py check --deploy``).

Each check names the environment variable to set. They run with ``--deploy`` (Django's own
deployment checks run beside them) and at the start of every production server process
(:func:`refuse_to_start_unless_deployable`, called by ``config.wsgi`` and ``config.celery``), so a
deployment with a missing secret, a published development secret, DEBUG on or no allowed host
does not serve a single request.
"""

from __future__ import annotations

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from config.secrets import secret_value

#: Shortest accepted secret key and webhook signing secret (characters).
MIN_SECRET_KEY_LENGTH = 50
MIN_WEBHOOK_SECRET_LENGTH = 32


#: Fewest distinct characters a secret may have (50 × "x" is long, not secret).
MIN_DISTINCT_CHARACTERS = 8


def _secret_problem(name: str, value: str, *, min_length: int = 16) -> str | None:
    """Why ``value`` (of environment variable ``name``) cannot be a production secret, or None:
    unset, a published development value or one built on it, too short, or too few distinct
    characters."""
    if not value:
        return f"{name} is not set"
    if value in settings.DEV_SECRETS.values():
        return f"{name} is a published development value"
    if any(dev in value for dev in settings.DEV_SECRETS.values()):
        return f"{name} is built on a published development value"
    if len(value) < min_length:
        return f"{name} is shorter than {min_length} characters"
    if len(set(value)) < MIN_DISTINCT_CHARACTERS:
        return f"{name} has fewer than {MIN_DISTINCT_CHARACTERS} distinct characters"
    return None


def _configured_secret_problem(conf: dict, name: str, env_name: str, **kwargs) -> str | None:
    """:func:`_secret_problem` of the secret ``conf[name]``, or of the file ``conf[name + "_FILE"]`` names
    (``env_name`` + ``_FILE``; a mounted secret, read as the tool gateway reads it)."""
    try:
        value = secret_value(conf.get(name, ""), conf.get(f"{name}_FILE", ""))
    except OSError as exc:
        return f"{env_name}_FILE names a file that cannot be read ({type(exc).__name__})"
    return _secret_problem(env_name, value, **kwargs)


def _url_problem(name: str, value: str) -> str | None:
    """Why ``value`` cannot be where production sends a credential: unset, or not https."""
    if not value:
        return f"{name} is not set"
    if not value.lower().startswith("https://"):
        return f"{name} is not an https URL (the credential sent to it would travel in clear)"
    return None


#: the tools whose listed destinations get a credential over HTTP (SMTP's is guarded by EMAIL_USE_TLS/SSL)
_HTTP_TOOLS = ("ticket.reference", "ticket.helpdesk", "model", "embeddings", "telemetry")


def _allow_list_problem(conf: dict) -> str | None:
    """Why a destination listed for a tool (``FAULTDESK_GATEWAY_ALLOW_<TOOL>``) or the span export's
    endpoint, when it carries headers, cannot be used in production: the gateway injects the tool's
    credential into every call to it, so it must be https."""
    from apps.gateway.destinations import destination_of

    for tool, urls in conf.get("GATEWAY_ALLOW", {}).items():
        env_name = "FAULTDESK_GATEWAY_ALLOW_" + tool.upper().replace(".", "_")
        for url in (u for u in urls if u and u.strip()):
            try:
                destination_of(url)
            except ValueError as exc:
                return f"{env_name} lists {url}, which cannot be read ({exc}): every call of {tool} would be refused"
            if tool in _HTTP_TOOLS and not url.lower().startswith("https://"):
                return f"{env_name} lists {url}, not https (the credential sent to it would travel in clear)"
    endpoint = conf.get("OTLP_TRACES_ENDPOINT", "")
    if endpoint and (conf.get("OTLP_HEADERS") or conf.get("OTLP_HEADERS_FILE")) \
            and not endpoint.lower().startswith("https://"):
        return "the OTLP traces endpoint is not https, and the OTLP headers sent to it would travel in clear"
    return None


def deploy_problems() -> list[checks.CheckMessage]:
    """Every reason the current settings cannot serve production, as check messages
    (``faultdesk.E001``–``E020``; errors, so ``check --deploy`` exits non-zero)."""
    conf = settings.FAULTDESK
    secret_key = "" if settings.SECRET_KEY == getattr(settings, "MISSING_SECRET_KEY", None) else settings.SECRET_KEY
    found: list[tuple[str, str | None, str]] = [
        ("E001", _secret_problem("DJANGO_SECRET_KEY", secret_key, min_length=MIN_SECRET_KEY_LENGTH),
         "generate one with `python -c 'import secrets; print(secrets.token_urlsafe(64))'`"),
        ("E002", "DEBUG is on (DJANGO_DEBUG)" if settings.DEBUG else None, "unset DJANGO_DEBUG"),
        ("E003", "DJANGO_ALLOWED_HOSTS is not set" if not settings.ALLOWED_HOSTS or "*" in settings.ALLOWED_HOSTS
         else None, "the host names the site is served under, comma-separated (not '*')"),
        ("E004", "DJANGO_CSRF_TRUSTED_ORIGINS is not set" if not settings.CSRF_TRUSTED_ORIGINS else None,
         "the https origin(s) of the site, e.g. https://faultdesk.example.com"),
        ("E005", "DATABASE_URL is not set" if settings.DATABASES["default"]["ENGINE"].endswith("dummy") else None,
         "postgres://user:password@host:5432/faultdesk (PostgreSQL with pgvector)"),
        ("E006", "CELERY_BROKER_URL and REDIS_URL are not set (no broker)" if not settings.CELERY_BROKER_URL
         else None, "amqp://user:password@host:5672/vhost (RabbitMQ) or redis://host:6379/0"),
        ("E007", _configured_secret_problem(conf, "REFSERVICE_API_KEY", "REFSERVICE_API_KEY"),
         "the reference ticket service's API key"),
        ("E008", _secret_problem("REFSERVICE_WEBHOOK_SECRET", conf["REFSERVICE_WEBHOOK_SECRET"],
                                 min_length=MIN_WEBHOOK_SECRET_LENGTH),
         "the secret the ticket service signs its webhooks with; anyone who knows it can close tickets"),
        ("E009", _configured_secret_problem(conf, "HELPDESK_API_TOKEN", "HELPDESK_API_TOKEN"),
         "django-helpdesk's API token"),
        ("E010", _configured_secret_problem(conf, "MODEL_API_KEY", "FAULTDESK_MODEL_API_KEY", min_length=1)
         if conf["MODEL_PROVIDER"] == "openai_compatible" else None, "the model server's API key"),
        ("E011", _secret_problem("FAULTDESK_METRICS_TOKEN", conf["METRICS_TOKEN"]),
         "a bearer token Prometheus sends to scrape /metrics (without it /metrics is anonymous)"),
        ("E012", _url_problem("REFSERVICE_URL", conf["REFSERVICE_URL"]), "the reference ticket service, https"),
        ("E013", _url_problem("HELPDESK_URL", conf["HELPDESK_URL"]), "django-helpdesk, https"),
        ("E014", _url_problem("FAULTDESK_MODEL_BASE_URL", conf["MODEL_BASE_URL"])
         if conf["MODEL_PROVIDER"] == "openai_compatible" else None, "the model server, https"),
        ("E015", next((f"DJANGO_CSRF_TRUSTED_ORIGINS has {o}, not https" for o in settings.CSRF_TRUSTED_ORIGINS
                       if not o.lower().startswith("https://")), None), "https origins only"),
        ("E016", "HSTS is off or under a day (DJANGO_SECURE_HSTS_SECONDS)"
         if getattr(settings, "SECURE_HSTS_SECONDS", 0) < 86400 else None, "31536000 (a year), the default"),
        ("E017", "the https redirect is off (DJANGO_SECURE_SSL_REDIRECT)"
         if not getattr(settings, "SECURE_SSL_REDIRECT", False) else None, "true, the default"),
        ("E018", "EMAIL_HOST is not set: notification e-mails would only be written to files"
         if settings.EMAIL_BACKEND.endswith("filebased.EmailBackend") else None,
         "the SMTP relay notifications are sent through (EMAIL_HOST, EMAIL_PORT, EMAIL_HOST_USER, …)"),
        ("E019", _url_problem("FAULTDESK_PUBLIC_BASE_URL", conf["PUBLIC_BASE_URL"]),
         "the site's https address: the links in API answers and in notification e-mails start with it"),
        ("E020", _allow_list_problem(conf),
         "https destinations only: the tool gateway injects the tool's credential into every call to them"),
    ]
    return [checks.Error(problem, hint=hint, id=f"faultdesk.{code}") for code, problem, hint in found if problem]


@checks.register(checks.Tags.security, deploy=True)
def check_deployable(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """The deploy checks of :func:`deploy_problems` (``manage.py check --deploy``)."""
    return deploy_problems()


def refuse_to_start_unless_deployable() -> None:
    """Raise ``ImproperlyConfigured`` naming every problem when the process runs the production
    settings and :func:`deploy_problems` finds any (the web and worker entry points call it)."""
    if settings.SETTINGS_MODULE != "config.settings.production":
        return
    problems = deploy_problems()
    if problems:
        raise ImproperlyConfigured("refusing to start: " + "; ".join(f"{p.id}: {p.msg}" for p in problems))
