"""The chaos run's long faults (tools/chaos/faults.py): a pause stops a worker's whole process group
and wakes it; the leases a paused process holds are found by its ``host:pid`` and seen to move on."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import p
from tests.procs import database_url
from tools.chaos import faults


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.django_db(transaction=True)
def test_a_pause_stops_every_process_of_the_group_then_wakes_them():
    proc = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60"], start_new_session=True)  # noqa: S607
    try:
        time.sleep(0.3)
        group = faults.process_group_pids(proc.pid)
        assert len(group) >= 2 and proc.pid in group
        seen: dict[int, str] = {}
        record: dict = {}
        pausing = threading.Thread(target=lambda: record.update(r=faults.pause(
            proc, "sleeper", 1.5, 1.0, database_url(), threading.Event(), tries=1)))
        pausing.start()
        time.sleep(0.7)
        seen = {pid: _state(pid) for pid in group}
        pausing.join(10)
        assert set(seen.values()) == {"T"}  # every process of the group stopped
        assert {_state(pid) for pid in group} <= {"S", "R"}  # and running again
        r = record["r"]
        assert r.kind == "pause" and r.held == 0 and r.recovery_seconds is None and 1.4 < r.seconds < 5
        assert r.note == "it held no lease at any of 1 looks"
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.allow_divergence  # the task's row is moved by hand, as a worker's commits would move it
@pytest.mark.django_db(transaction=True)
def test_the_leases_a_process_holds_are_found_and_seen_to_move_on(requester, device):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    owner = f"{os.uname().nodename}:424242"
    Task.objects.filter(pk=task.pk).update(status="RETRIEVING", lease_owner=owner,
                                           lease_expires_at=timezone.now() + timedelta(seconds=30))
    url = database_url()
    held = faults.held_leases(url, [owner])
    generation = Task.objects.get(pk=task.pk).lease_generation
    assert held == {f"task:{task.pk}": (generation, "RETRIEVING")}
    assert faults.held_leases(url, [f"{os.uname().nodename}:1"]) == {}
    assert faults.still_held(url, held) == {f"task:{task.pk}"}
    Task.objects.filter(pk=task.pk).update(version=task.version + 1)  # the holder's own last commit landing
    assert faults.still_held(url, held) == {f"task:{task.pk}"}  # is not a takeover
    Task.objects.filter(pk=task.pk).update(lease_generation=generation + 1)  # another worker took it over
    assert faults.still_held(url, held) == set()
    # an expired lease is not held
    Task.objects.filter(pk=task.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert faults.held_leases(url, [owner]) == {}


@pytest.mark.allow_divergence  # the outbox row is moved by hand, as a dispatcher would move it
@pytest.mark.django_db(transaction=True)
def test_an_outbox_row_a_dispatcher_holds_is_found_and_seen_to_move_on(requester, approver, device, kb, refservice):
    from apps.approvals.models import ApprovalRequest
    from apps.approvals.services import approval_decide
    from apps.outbox.models import OutboxMessage
    from tests.conftest import drive

    task = task_submit(principal=p(requester), device_id=device.pk, symptom="Fuser error after warm-up.").task
    drive(task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    drive(task.pk)
    row = OutboxMessage.objects.get(action__task_id=task.pk)
    owner = f"{os.uname().nodename}:515151"
    OutboxMessage.objects.filter(pk=row.pk).update(status="IN_FLIGHT", lease_owner=owner, lease_generation=3,
                                                   lease_expires_at=timezone.now() + timedelta(seconds=30))
    url = database_url()
    held = faults.held_leases(url, [owner])
    assert held == {f"outbox:{row.pk}": (3, "IN_FLIGHT")}
    assert faults.still_held(url, held) == {f"outbox:{row.pk}"}
    OutboxMessage.objects.filter(pk=row.pk).update(lease_generation=4, lease_owner="another:1")  # taken over
    assert faults.still_held(url, held) == set()
