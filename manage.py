#!/usr/bin/env python
"""Django's command-line utility for faultdesk. Production settings unless
``DJANGO_SETTINGS_MODULE`` — or the ``.env`` file that ``make`` writes for development — names
others (``config.settings.local`` for the embedded development stack)."""

import os
import sys


def main() -> None:
    import config.env  # noqa: F401 - reads .env into the environment

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
