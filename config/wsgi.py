"""WSGI entry point (gunicorn ``config.wsgi``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")

import config.env  # noqa: E402, F401 - reads .env into the environment, as the settings do
from config.tracing import setup_tracing  # noqa: E402 - after the settings module is named

setup_tracing("web")  # before the handler loads its middleware; a no-op without an OTLP endpoint
application = get_wsgi_application()
