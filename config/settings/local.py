"""Local development and `make demo` / `make up`."""

from config.settings.base import *  # noqa: F403
from config.env import env

DEBUG = env.bool("DJANGO_DEBUG", default=True)
