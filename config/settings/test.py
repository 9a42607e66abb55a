"""Settings for the test suite (pytest-django)."""

from config.env import VAR_DIR as _VAR_DIR
from config.settings.base import *  # noqa: F403

# Fast hashing for in-process tests; PBKDF2 stays available so end-to-end tests can create users the
# server processes (running the local settings) can authenticate.
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.MD5PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
CELERY_TASK_ALWAYS_EAGER = False
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "attachments": {"BACKEND": "django.core.files.storage.FileSystemStorage",
                    "OPTIONS": {"location": str(_VAR_DIR / "test-attachments"), "base_url": None}},
}

import os  # noqa: E402

from config import embedded  # noqa: E402
from config.database import binding_options, timeout_options  # noqa: E402
from config.env import env  # noqa: E402

# The test session needs PostgreSQL with pgvector: with no DATABASE_URL it starts the embedded one
# here, before pytest-django opens the first connection (idempotent; ~0.3 s when already running).
if "DATABASE_URL" not in os.environ:
    DATABASES = {"default": env.db_url_config(embedded.ensure_postgres())}  # noqa: F405
# The session timeouts of every setting, except the idle-in-transaction one: pytest-django keeps each
# test's transaction open while the test waits on threads and processes, which is not a stuck client.
DATABASES["default"] = timeout_options(  # noqa: F405
    DATABASES["default"], **{**DATABASE_TIMEOUTS, "idle_in_transaction_ms": 0})  # noqa: F405
DATABASES["default"] = binding_options(DATABASES["default"],  # noqa: F405
                                       prepare_threshold=DATABASE_PREPARE_THRESHOLD)  # noqa: F405

# In-process tests never talk to a broker; end-to-end tests give their worker processes a real one.
CELERY_BROKER_URL = "memory://"
CACHES = {**CACHES, "coordination": coordination_cache(CELERY_BROKER_URL)}  # noqa: F405
# Retries in tests need no wall-clock wait: backoff is tested through backoff_delay directly.
# Metrics are computed at every scrape: a test reads them right after changing rows.
FAULTDESK = {**FAULTDESK, "SNAPSHOT_EVERY": 4, "RETRY_BACKOFF_BASE_SECONDS": 0.0,  # noqa: F405
             "METRICS_CACHE_SECONDS": 0,
             # in-process tests see every kick (tests of the coalescing turn it on)
             "KICK_COALESCE_SECONDS": 0,
             # in-process tests drive the dispatcher's path step by step; the tests of direct
             # delivery turn it on, and the end-to-end and chaos runs use the default (on)
             "OUTBOX_DIRECT_DELIVERY": False}
