"""Production: every URL and secret must come from the environment."""

from config.env import env
from config.settings.base import *  # noqa: F403

DEBUG = False
SECRET_KEY = env("DJANGO_SECRET_KEY")
DATABASES = {"default": {**PERSISTENT_CONNECTIONS, **env.db("DATABASE_URL")}}  # noqa: F405
CELERY_BROKER_URL = env("REDIS_URL")
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
