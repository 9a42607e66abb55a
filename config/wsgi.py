"""WSGI entry point (gunicorn ``config.wsgi``). Production unless ``DJANGO_SETTINGS_MODULE`` (or
the ``.env`` file development writes) says otherwise; a production web process with a missing or
development secret refuses to start (config/deploy_checks.py)."""

import os

import config.env  # noqa: F401 - reads .env into the environment first, as the settings do

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")

from django.core.wsgi import get_wsgi_application  # noqa: E402

from config.tracing import setup_tracing  # noqa: E402 - after the settings module is named

setup_tracing("web")  # before the handler loads its middleware; a no-op without an OTLP endpoint
application = get_wsgi_application()

from config.deploy_checks import refuse_to_start_unless_deployable  # noqa: E402 - needs the app registry

refuse_to_start_unless_deployable()
