"""Notifications sent exactly once across a worker crash, with real processes: a Celery worker
(solo pool: the worker is the process that sends) SIGKILLed by a failpoint, then a new worker,
beat ticking the sender every second, a real SMTP server on loopback (aiosmtpd) and the test
database (the acceptance criterion "notifications being sent exactly once across a worker crash").

* killed before the send (``notify_before_send``): nothing reached the server; once the dead
  worker's lease expires the next worker claims the rows and each notification arrives once;
* killed after the server accepted a message and before it was marked sent
  (``notify_after_send``): that one message is sent again — as the same message, with the same
  Message-ID and ``X-Faultdesk-Notification`` — so the server holds one distinct message per
  notification, and only the message in the window was received twice.

The processes use their own Redis database (not tests/procs.py's, which another suite's stack
flushes) and free ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from django.utils import timezone

from apps.notifications.models import DeliveryStatus, Notification, NotificationKind
from apps.notifications.projections import message_id_for
from tests.procs import broker_url, flush_broker

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

#: the Redis database of these processes' broker (tests/procs.py's stack uses 9)
BROKER_DB = 13
LEASE_SECONDS = 2


class Procs:
    """The worker and beat processes of one test, logging into ``log_dir``."""

    def __init__(self, log_dir: Path, smtp_port: int):
        from tests.procs import database_url

        self.log_dir = log_dir
        self.broker = broker_url(BROKER_DB)
        flush_broker(self.broker, BROKER_DB)
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.local", "DJANGO_DEBUG": "false",
                    "DATABASE_URL": database_url(), "REDIS_URL": self.broker, "PYTHONUNBUFFERED": "1",
                    "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
                    "EMAIL_HOST": "127.0.0.1", "EMAIL_PORT": str(smtp_port),
                    "FAULTDESK_NOTIFY_LEASE_SECONDS": str(LEASE_SECONDS),
                    "FAULTDESK_NOTIFY_TICK_SECONDS": "1"}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], **env_extra: str) -> subprocess.Popen:
        from tests.procs import BIN, ROOT

        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen([str(BIN / "celery"), "-A", "config", *args], cwd=ROOT,  # noqa: S603
                                env={**self.env, **env_extra}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def worker(self, name: str, **env_extra: str) -> subprocess.Popen:
        return self.start(name, ["worker", "-Q", "outbox", "-n", f"{name}-{os.getpid()}@%h", "-P", "solo",
                                 "--loglevel", "INFO"], **env_extra)

    def beat(self) -> None:
        self.start("beat", ["beat", "-s", str(self.log_dir / "beat-schedule"), "--loglevel", "INFO"])

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.log_dir.glob("*.log"))

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        flush_broker(self.broker, BROKER_DB)


@pytest.fixture
def procs(smtp_server, tmp_path):
    _sink, port = smtp_server
    p = Procs(tmp_path, port)
    try:
        yield p
    finally:
        p.stop_all()


def _notifications(user, n: int) -> list[Notification]:
    rows = []
    for i in range(n):
        row = Notification(tenant_id=user.memberships.get().tenant_id, recipient=user,
                           kind=NotificationKind.TICKET_CREATED,
                           context={"ticket": f"REF-00000{i + 1}", "asset_tag": "PRN-0417"},
                           status=DeliveryStatus.PENDING, next_attempt_at=timezone.now())
        row.message_id = message_id_for(row.pk)
        row.save(force_insert=True)
        rows.append(row)
    return rows


def _wait(predicate, timeout: float, procs: Procs, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {timeout} s\n{procs.logs()}")


def _crash_then_recover(procs: Procs, point: str, rows: list[Notification], tmp_path) -> list:
    """A worker killed at ``point`` (once), then a new worker; returns the rows once all are SENT."""
    fired = tmp_path / "failpoint-fired"
    doomed = procs.worker("doomed", FAULTDESK_FAILPOINT=point, FAULTDESK_FAILPOINT_ONCE=str(fired))
    procs.beat()
    _wait(fired.exists, 90, procs, f"the failpoint {point}")
    assert doomed.wait(timeout=30) == -signal.SIGKILL
    ids = [r.pk for r in rows]
    # the dead worker claimed them: each is SENDING under its lease, one attempt spent
    claimed = Notification.objects.filter(pk__in=ids, status=DeliveryStatus.SENDING)
    assert claimed.count() == len(rows), procs.logs()
    procs.worker("survivor")
    _wait(lambda: Notification.objects.filter(pk__in=ids, status=DeliveryStatus.SENT).count() == len(rows), 90,
          procs, "sending every notification")
    return list(Notification.objects.filter(pk__in=ids).order_by("created_at"))


def _received(sink) -> list[tuple[str, str]]:
    return [(m["X-Faultdesk-Notification"], m["Message-ID"]) for _rcpt, m in sink.messages]


def test_a_worker_killed_before_the_send_each_notification_arrives_once(procs, smtp_server, mailed, tmp_path):
    sink, _port = smtp_server
    rows = _notifications(mailed["riley"], 3)
    sent = _crash_then_recover(procs, "notify_before_send", rows, tmp_path)
    time.sleep(LEASE_SECONDS + 1.5)  # a few more beat ticks: nothing else goes out
    received = _received(sink)
    assert len(received) == 3, received
    assert Counter(notification for notification, _ in received) == Counter(str(r.pk) for r in rows)
    for row in sent:
        assert (str(row.pk), row.message_id) in received
        # claimed by the dead worker (token 1), then by the survivor (token 2), which sent it
        assert row.attempts == 2 and row.lease_generation == 2 and row.email_to == "riley@acme.test"


def test_a_worker_killed_after_the_server_accepted_resends_the_same_message(procs, smtp_server, mailed, tmp_path):
    sink, _port = smtp_server
    rows = _notifications(mailed["riley"], 3)
    sent = _crash_then_recover(procs, "notify_after_send", rows, tmp_path)
    time.sleep(LEASE_SECONDS + 1.5)
    received = _received(sink)
    # the one accepted before the kill arrived twice, as the same message; the others once
    assert len(received) == 4, received
    per_message = Counter(message_id for _, message_id in received)
    assert len(per_message) == 3 and sorted(per_message.values()) == [1, 1, 2]
    assert {message_id for _, message_id in received} == {r.message_id for r in sent}
    assert all(notification == str(Notification.objects.get(message_id=mid).pk) for notification, mid in received)
    twice = next(mid for mid, count in per_message.items() if count == 2)
    resent = Notification.objects.get(message_id=twice)
    assert resent.status == DeliveryStatus.SENT and resent.attempts == 2
