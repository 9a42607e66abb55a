"""Production — the default settings of every entry point a deployment runs (``manage.py``,
``config.wsgi``, ``config.celery``); development opts in to ``config.settings.local`` (the
Makefile writes it into ``.env``, devstack sets it).

Every URL and secret comes from the environment and nothing falls back to a published
development value. A missing or development value does not stop the import: the deploy system
checks (``config/deploy_checks.py``; ``manage.py check --deploy``) name every one of them, and the
web and worker entry points run those checks and refuse to start while one fails.
"""

from config.database import binding_options, timeout_options
from config.env import env
from config.settings.base import *  # noqa: F403

DEBUG = env.bool("DJANGO_DEBUG", default=False)
# Django refuses an empty key on first use; this marker lets the deploy checks say what is missing
# (and the web and worker processes refuse to start with it).
MISSING_SECRET_KEY = "!unset: DJANGO_SECRET_KEY"  # noqa: S105 - a marker, not a key
SECRET_KEY = env("DJANGO_SECRET_KEY", default="") or MISSING_SECRET_KEY
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=[])
# The https origins the site is served from (e.g. https://faultdesk.example.com), for the CSRF
# check of forms and of session-authenticated API writes behind a TLS-terminating proxy.
CSRF_TRUSTED_ORIGINS = env.list("DJANGO_CSRF_TRUSTED_ORIGINS", default=[])

_database_url = env("DATABASE_URL", default="")
DATABASES = {"default": {**PERSISTENT_CONNECTIONS, **env.db_url_config(_database_url)} if _database_url  # noqa: F405
             else {"ENGINE": "django.db.backends.dummy"}}
DATABASES["default"]["ATOMIC_REQUESTS"] = False
if _database_url:
    DATABASES["default"] = timeout_options(DATABASES["default"], **DATABASE_TIMEOUTS)  # noqa: F405
    DATABASES["default"] = binding_options(DATABASES["default"],  # noqa: F405
                                           prepare_threshold=DATABASE_PREPARE_THRESHOLD)  # noqa: F405
# The broker: CELERY_BROKER_URL (amqp://… for RabbitMQ, or redis://…), else REDIS_URL. REDIS_URL is
# also the coordination cache's store; without Redis the hints fall back to always sending.
REDIS_URL = env("REDIS_URL", default="")
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="") or REDIS_URL
CACHES = {**CACHES, "coordination": coordination_cache(REDIS_URL)}  # noqa: F405

FAULTDESK = {  # noqa: F405 - no development secret survives: each is read again, without a default
    **FAULTDESK,  # noqa: F405
    "REFSERVICE_API_KEY": env("REFSERVICE_API_KEY", default=""),
    "REFSERVICE_WEBHOOK_SECRET": env("REFSERVICE_WEBHOOK_SECRET", default=""),
    "HELPDESK_API_TOKEN": env("HELPDESK_API_TOKEN", default=""),
    "MODEL_API_KEY": env("FAULTDESK_MODEL_API_KEY", default=""),
    "METRICS_TOKEN": env("FAULTDESK_METRICS_TOKEN", default=""),
    "PUBLIC_BASE_URL": env("FAULTDESK_PUBLIC_BASE_URL", default=""),
    # Where the credentials above are sent: no loopback default of the development stack.
    "REFSERVICE_URL": env("REFSERVICE_URL", default=""),
    "HELPDESK_URL": env("HELPDESK_URL", default=""),
    "MODEL_BASE_URL": env("FAULTDESK_MODEL_BASE_URL", default=""),
}

# --- transport security: TLS is terminated by a proxy that sets X-Forwarded-Proto -------------
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("DJANGO_SECURE_SSL_REDIRECT", default=True)
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # the load balancer's probe speaks plain HTTP to the pod
SECURE_HSTS_SECONDS = env.int("DJANGO_SECURE_HSTS_SECONDS", default=31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
SECURE_HSTS_PRELOAD = env.bool("DJANGO_SECURE_HSTS_PRELOAD", default=True)
SECURE_CONTENT_TYPE_NOSNIFF = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True

# The API speaks JSON only: no browsable HTML renderer (its forms and inline data) in production.
REST_FRAMEWORK = {**REST_FRAMEWORK, "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]}  # noqa: F405
