"""WSGI entry point of the helpdesk project (``gunicorn tools.helpdesk_site.wsgi``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tools.helpdesk_site.settings")
application = get_wsgi_application()
