"""Local development and `make demo` / `make up`."""

from config.env import env
from config.settings.base import *  # noqa: F403

DEBUG = env.bool("DJANGO_DEBUG", default=True)
