"""Standalone django-helpdesk 2.6.1 project, reached by faultdesk over REST only.

Everything that matters is overridable from the environment so the same file
serves a dev box, CI and a test run on a random port with a throw-away DB.
"""
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parents[2]
VAR_DIR = Path(os.environ.get("HELPDESK_VAR_DIR", BASE_DIR / "var" / "helpdesk"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("HELPDESK_SECRET_KEY", "dev-only-not-secret")
DEBUG = os.environ.get("HELPDESK_DEBUG", "0") == "1"
ALLOWED_HOSTS = os.environ.get("HELPDESK_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",        # queue / custom-field maintenance by a human
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.sites",        # helpdesk.lib.build_base_url / email context
    "django.contrib.humanize",     # helpdesk templates {% load humanize %}
    "rest_framework",
    "rest_framework.authtoken",    # TokenAuthentication for the machine client
    "helpdesk",
    "tools.helpdesk_site.bridge",  # bootstrap command + lookup-by-custom-field views
]
# NOT needed in 2.6.x: bootstrap4form (templates use helpdesk's own
# bootstrap5_form tag), pinax-teams/account/reversion (turned off below).

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tools.helpdesk_site.urls"
WSGI_APPLICATION = "tools.helpdesk_site.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("HELPDESK_DB_PATH", str(VAR_DIR / "helpdesk.sqlite3")),
        # one request == one transaction: a failed ticket create leaves no half row
        "ATOMIC_REQUESTS": True,
        "OPTIONS": {"timeout": 20},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

AUTH_PASSWORD_VALIDATORS = []
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

SITE_ID = 1

STATIC_URL = "/static/"
STATIC_ROOT = str(VAR_DIR / "static")
MEDIA_URL = "/media/"
MEDIA_ROOT = str(VAR_DIR / "media")      # attachments land in MEDIA_ROOT/helpdesk/

LOGIN_URL = "/helpdesk/login/"
LOGIN_REDIRECT_URL = "/helpdesk/"

# No mail leaves this box; helpdesk sends on every create/follow-up.
EMAIL_BACKEND = os.environ.get(
    "HELPDESK_EMAIL_BACKEND", "django.core.mail.backends.dummy.EmailBackend"
)
DEFAULT_FROM_EMAIL = "helpdesk@localhost"

# ---- django-helpdesk ----
HELPDESK_TEAMS_MODE_ENABLED = False   # default True -> needs pinax-teams + its migrations
# HELPDESK_KB_ENABLED must stay True (default): with False, 2.6.1 helpdesk/urls.py
# raises NameError: name 'kb' is not defined (KNOWLEDGE_BASE_PATTERNS built unconditionally).
HELPDESK_KB_ENABLED = True
HELPDESK_API_ENABLED = True           # default True; /helpdesk/api/...
HELPDESK_UI_ENABLED = True            # staff web UI for humans; API works either way
HELPDESK_ENABLE_PER_QUEUE_STAFF_PERMISSION = False
HELPDESK_REDIRECT_TO_LOGIN_BY_DEFAULT = True

# ---- DRF: what the helpdesk API views use (they only set permission_classes) ----
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",  # "Authorization: Token <key>"
        "rest_framework.authentication.BasicAuthentication",  # works, but PBKDF2 per request
        "rest_framework.authentication.SessionAuthentication",  # browsable API for humans
    ],
    # IntegrityError (duplicate unique custom-field value) -> 409 + rollback
    "EXCEPTION_HANDLER": "tools.helpdesk_site.bridge.exceptions.exception_handler",
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
# faultdesk sends a report's photos, logs and PDF documents as follow-up attachments: helpdesk's
# default list has no .log, .json, .cfg or .webp (faultdesk checks every file by its content first).
HELPDESK_VALID_EXTENSIONS = [".txt", ".log", ".csv", ".json", ".xml", ".cfg", ".conf", ".ini", ".out", ".text",
                             ".pdf", ".png", ".jpg", ".jpeg", ".jfif", ".gif", ".webp"]
