"""WSGI entry point of the helpdesk project (``gunicorn apps.tickets.helpdesk_site.wsgi``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "apps.tickets.helpdesk_site.settings")
application = get_wsgi_application()
