"""The apps' unit tests use the suite's shared fixtures (tests/conftest.py): the tenant, its
people, a device, the knowledge base, the reference ticket service and the in-process driver."""

from tests.conftest import *  # noqa: F403
