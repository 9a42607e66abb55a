"""Fixtures of the notification tests: people with e-mail addresses (and, for one, a saved
language), and a real SMTP server on loopback (aiosmtpd) that keeps every message it accepts."""

from __future__ import annotations

import email
import email.policy
import socket
import threading

import pytest

from apps.accounts.models import AccessScope, LanguagePreference, Role
from tests.factories import MembershipFactory, UserFactory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SmtpSink:
    """The messages a real SMTP server accepted: ``[(envelope recipients, parsed message)]``.
    ``refuse`` makes the next N transactions fail with ``(code, text)``."""

    def __init__(self):
        self.messages: list[tuple[list[str], email.message.EmailMessage]] = []
        self.refusals: list[str] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd's hook name
        with self.lock:
            if self.refusals:
                return self.refusals.pop(0)
            parsed = email.message_from_bytes(envelope.original_content or envelope.content,
                                              policy=email.policy.default)
            self.messages.append((list(envelope.rcpt_tos), parsed))
        return "250 Message accepted for delivery"

    def refuse(self, reply: str, times: int = 1) -> None:
        self.refusals += [reply] * times

    def to(self, address: str) -> list:
        return [m for rcpt, m in self.messages if address in rcpt]


@pytest.fixture
def smtp_server():
    """A real SMTP server (aiosmtpd) on a free loopback port; yields ``(sink, port)``."""
    from aiosmtpd.controller import Controller

    sink = SmtpSink()
    port = free_port()
    controller = Controller(sink, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield sink, port
    finally:
        controller.stop()


@pytest.fixture
def smtp(smtp_server, settings):
    """Django's SMTP backend pointed at :func:`smtp_server`; yields the sink."""
    sink, port = smtp_server
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    settings.EMAIL_TIMEOUT = 5
    return sink


@pytest.fixture
def mailed(requester, approver, admin_user):
    """The tenant's requester (riley, English), approver (avery, Chinese saved) and admin (adele)
    with e-mail addresses."""
    for user, address in ((requester, "riley@acme.test"), (approver, "avery@acme.test"),
                          (admin_user, "adele@acme.test")):
        user.email = address
        user.save(update_fields=["email"])
    LanguagePreference.objects.create(user=approver, language="zh-hans")
    return {"riley": requester, "avery": approver, "adele": admin_user}


def add_member(tenant, username: str, role: str, address: str = ""):
    user = UserFactory(username=username, email=address)
    MembershipFactory(user=user, tenant=tenant, role=role, scopes=list(AccessScope.values))
    return user


__all__ = ["Role", "add_member", "free_port"]
