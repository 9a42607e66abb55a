"""django-helpdesk 2.6 as faultdesk's second, third-party ticket system (DESIGN.md §11; ADR
0010): its own Django project, in its own process and its own SQLite database, reached by
faultdesk only through its REST API (:class:`apps.tickets.connectors.HelpdeskConnector`).

Run it::

    DJANGO_SETTINGS_MODULE=tools.helpdesk_site.settings HELPDESK_VAR_DIR=var/helpdesk \\
        .venv/bin/python -m tools.helpdesk_site migrate
    ... -m tools.helpdesk_site hd_bootstrap --token <40 chars>
    ... gunicorn tools.helpdesk_site.wsgi -b 127.0.0.1:8766 --timeout 30

django-helpdesk has no idempotency support. faultdesk writes each action's idempotency key into
the custom field ``faultdesk_key`` and, before any retry, looks the key up (the ``bridge`` app's
read-only views, which the stock API lacks). A unique index on the key's values
(``hd_bootstrap --unique-field faultdesk_key``) is this deployment's safety net for the one race
a lookup cannot close: a request still travelling when the lookup ran.
"""
