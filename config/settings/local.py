"""Local development and `make demo` / `make up`."""

import os

from config.env import env
from config.settings.base import *  # noqa: F403

DEBUG = env.bool("DJANGO_DEBUG", default=True)

# Django's password hashers unless DJANGO_PASSWORD_HASHERS (comma-separated dotted paths) names
# others. The test suite's server processes (tests/procs.py) put a fast hasher first: their
# clients sign in with basic auth on every poll, and one PBKDF2 check costs about 0.6 s of the CPU
# the workers under test need. production.py never reads it.
if os.environ.get("DJANGO_PASSWORD_HASHERS"):
    PASSWORD_HASHERS = env.list("DJANGO_PASSWORD_HASHERS")
