"""Concurrent decisions on one approval over real HTTP (ADR 0012): double clicks, approve against
reject, two approvers — fired at the same moment at the real web server (gunicorn, 2 processes × 2
threads). Exactly one decision takes effect; every other gets 409 with the current decision; never a
500, never a second outbox row."""

from __future__ import annotations

import threading

import httpx
import pytest
from django.contrib.auth.hashers import make_password

from apps.accounts.models import AccessScope, Role
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.outbox.models import OutboxMessage
from apps.tasks.models import Task
from tests.factories import MembershipFactory, UserFactory
from tests.procs import running_stack
from tests.test_e2e import poll, seed_acme

pytestmark = pytest.mark.django_db(transaction=True)

ROUNDS = [
    ("double click", [("avery", "approve")] * 4),
    ("approve against reject", [("avery", "approve"), ("alex", "reject"), ("avery", "reject"), ("alex", "approve")]),
    ("two approvers", [("avery", "approve"), ("alex", "approve"), ("avery", "approve"), ("alex", "approve")]),
]


def test_concurrent_decisions_over_http_exactly_one_wins(tmp_path):
    tenant, requester, device = seed_acme()
    alex = MembershipFactory(user=UserFactory(username="alex"), tenant=tenant, role=Role.APPROVER,
                             scopes=list(AccessScope.values)).user
    alex.password = make_password("pw-for-tests", hasher="pbkdf2_sha256")
    alex.save(update_fields=["password"])
    with running_stack(tmp_path) as stack:
        stack.start_worker("worker")
        riley = httpx.Client(base_url=stack.web, auth=("riley", "pw-for-tests"), timeout=30)
        clients = {name: httpx.Client(base_url=stack.web, timeout=30) for name in ("avery", "alex")}
        for name, client in clients.items():  # a session each: no password hashing inside the race
            client.get("/login/")
            resp = client.post("/login/", data={"username": name, "password": "pw-for-tests",
                                                "csrfmiddlewaretoken": client.cookies["csrftoken"]})
            assert resp.status_code == 302, resp.text
        for label, decisions in ROUNDS:
            task_id = riley.post("/api/tasks/", json={"device_id": device.pk, "symptom": f"Fuser error, {label}.",
                                                      "urgency": "high"}).raise_for_status().json()["id"]
            poll(riley, task_id, {"WAITING_APPROVAL"}, 120, stack)
            approval = ApprovalRequest.objects.get(task_id=task_id)
            barrier = threading.Barrier(len(decisions))
            results: list[tuple[str, str, int, dict]] = []

            def decide(name, decision, approval=approval, barrier=barrier, results=results):
                client = clients[name]
                barrier.wait()
                resp = client.post(f"/api/approvals/{approval.pk}/decision/",
                                   json={"decision": decision, "reason": "race"},
                                   headers={"X-CSRFToken": client.cookies["csrftoken"]})
                results.append((name, decision, resp.status_code, resp.json()))

            threads = [threading.Thread(target=decide, args=d) for d in decisions]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            codes = sorted(r[2] for r in results)
            assert codes == [200] + [409] * (len(decisions) - 1), (label, results)
            winner = next(r for r in results if r[2] == 200)
            final = ApprovalRequest.objects.get(pk=approval.pk)
            expected = ApprovalStatus.APPROVED if winner[1] == "approve" else ApprovalStatus.REJECTED
            assert final.status == expected and final.decided_by.username == winner[0], (label, results)
            for _, _, code, body in results:
                if code == 409:
                    assert body["error"] == "conflict" and body["status"] == expected, (label, body)
                    assert body["decided_by"] == winner[0]
            done = poll(riley, task_id, {"COMPLETED"}, 120, stack)
            rows = OutboxMessage.objects.filter(action__task_id=task_id).count()
            assert rows == (1 if expected == ApprovalStatus.APPROVED else 0), (label, rows)
            assert done["status"] == "COMPLETED"
            assert Task.objects.get(pk=task_id).events.filter(
                type__in=["approval.granted", "approval.rejected"]).count() == 1
        assert "Internal Server Error" not in stack.log("web")
