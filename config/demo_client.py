"""The demo's HTTP client: runs the main job through the public API exactly as people would —
the requester files a fault request, the approver approves the proposed ticket, and the client
waits for the receipt — then prints the answer, citations, ticket id and trace URL.

Its last line on success is ``DEMO OK task=<task id> ticket=<external ticket id>``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import httpx

DEMO_DEVICE = "PRN-0417"
SYMPTOM = (
    "The 3rd floor MFP shows a fuser error right after warm-up and every page comes out with smeared, "
    "unfused toner. Power-cycling did not help."
)


def _say(msg: str) -> None:
    print(msg, flush=True)


def _poll(client: httpx.Client, task_id: str, until: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        task = client.get(f"/api/tasks/{task_id}/").raise_for_status().json()
        if task["status"] != last:
            last = task["status"]
            _say(f"  … {last} (version {task['version']})")
        if task["status"] in until or task["status"] in {"FAILED", "CANCELLED"}:
            return task
        time.sleep(0.5)
    raise TimeoutError(f"task {task_id} did not reach {sorted(until)} within {timeout}s (last {last})")


def run(*, base_url: str, refservice_url: str, credentials_path: Path, timeout: float = 180.0,
        before_ok=None) -> bool:
    """Run the main job against a running faultdesk. Returns True when it ended with a receipt
    and the ticket service holds exactly one ticket for the action's idempotency key.
    ``before_ok()`` runs just before the final ``DEMO OK`` line (the launcher replays every task
    there); an exception from it fails the demo."""
    creds = json.loads(credentials_path.read_text())
    requester = httpx.Client(base_url=base_url, auth=("riley", creds["riley"]), timeout=30)
    approver = httpx.Client(base_url=base_url, auth=("avery", creds["avery"]), timeout=30)

    devices = requester.get("/api/devices/", params={"asset_tag": DEMO_DEVICE}).raise_for_status().json()
    device = devices[0]
    _say(f"\n1. riley files a fault request for {device['asset_tag']} ({device['name']}, "
         f"{device['state']}, alert {device['alert_code']}, object version {device['version']})")
    key = f"demo-{uuid.uuid4()}"
    body = {"device_id": device["id"], "symptom": SYMPTOM, "urgency": "high"}
    resp = requester.post("/api/tasks/", json=body, headers={"Idempotency-Key": key})
    resp.raise_for_status()
    task = resp.json()
    again = requester.post("/api/tasks/", json=body, headers={"Idempotency-Key": key}).raise_for_status().json()
    assert again["id"] == task["id"], "same Idempotency-Key must return the same task"
    _say(f"   POST /api/tasks/ (Idempotency-Key {key}) → {resp.status_code}, task {task['id']}; "
         f"the same key again → the same task")

    task = _poll(requester, task["id"], {"WAITING_APPROVAL", "COMPLETED"}, timeout)
    if task["status"] != "WAITING_APPROVAL":
        _say(f"DEMO FAILED: task ended {task['status']}: {task['termination_reason']}")
        return False

    approvals = approver.get("/api/approvals/", params={"status": "PENDING", "task": task["id"]}).raise_for_status()
    approval = approvals.json()[0]
    p = approval["params"]
    _say(f"\n2. avery reviews the proposal: {approval['tool']} on {approval['device']} "
         f"({approval['object_type']} version {approval['object_version']}, policy v{approval['policy_version']})")
    if approval["tool"] == "ticket.comment":  # the device's faultdesk ticket is still open (reducer/2)
        _say(f"   a comment on the open ticket {p['ticket_id']}, only while it is at version {p['if_match']} "
             f"· digest {approval['action_digest'][:16]}…")
    else:
        _say(f"   title: {p['title']}\n   priority: {p['priority']} · digest {approval['action_digest'][:16]}…")
    decision = approver.post(f"/api/approvals/{approval['id']}/decision/",
                             json={"decision": "approve", "reason": "Matches the fuser procedure; go ahead."})
    decision.raise_for_status()
    _say(f"   POST /api/approvals/{approval['id']}/decision/ → {decision.status_code} {decision.json()['status']}")

    _say("\n3. waiting for the ticket system's receipt")
    task = _poll(requester, task["id"], {"COMPLETED"}, timeout)
    if task["status"] != "COMPLETED" or not task["receipt"]:
        _say(f"DEMO FAILED: task ended {task['status']}: {task['termination_reason']}")
        return False
    answer = task["answer"]
    ticket_id = task["receipt"]["external_id"]
    _say("\n4. the answer\n")
    _say(answer["knowledge"]["text"])
    _say("\n   citations:")
    for c in answer["knowledge"]["citations"]:
        _say(f"   [{c['n']}] {c['document_title']} — version {c['version']}, § {c['section']} ({c['source']})")
    _say(f"\n   {answer['status_note']}")
    _say(f"   trace: {task['links']['trace']}")

    api_key = os.environ.get("REFSERVICE_API_KEY", "faultdesk-refservice-dev-key")
    action_key = None
    events = httpx.get(f"{base_url}/api/tasks/{task['id']}/events/", auth=("adele", creds["adele"]), timeout=30)
    for e in events.raise_for_status().json():
        if e["type"] == "intent.committed":
            action_key = e["payload"]["idempotency_key"]
    system = task["receipt"].get("connector", "reference")
    if system == "helpdesk":  # the tenant files its tickets in django-helpdesk
        held = httpx.get(
            f"{os.environ.get('HELPDESK_URL', 'http://127.0.0.1:8766')}/helpdesk/api/faultdesk/tickets/by-custom-field/",
            params={"field": "faultdesk_key", "value": action_key}, timeout=10,
            headers={"Authorization": f"Token {os.environ.get('HELPDESK_API_TOKEN', '')}"},
        ).raise_for_status().json()["results"]
    elif task["receipt"].get("kind") == "comment":  # a second run comments on the first run's open ticket
        on = task["receipt"]["ticket_id"]
        found = httpx.get(f"{refservice_url}/tickets/{on}/comments", params={"idempotency_key": action_key},
                          timeout=10, headers={"Authorization": f"Bearer {api_key}"})
        held = [{"id": c["comment"]["id"]} for c in found.raise_for_status().json()["results"]]
    else:
        held = httpx.get(f"{refservice_url}/tickets", params={"idempotency_key": action_key}, timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"}).raise_for_status().json()["results"]
    what = "comment" if task["receipt"].get("kind") == "comment" else "ticket"
    if len(held) != 1 or str(held[0]["id"]) != ticket_id:
        _say(f"DEMO FAILED: the {system} ticket system holds {len(held)} {what}s for key {action_key}")
        return False
    _say(f"   the {system} ticket system holds exactly one {what} for key {action_key}: {ticket_id}\n")
    if before_ok is not None:
        before_ok()
    _say(f"DEMO OK task={task['id']} ticket={ticket_id}")
    return True


if __name__ == "__main__":  # pragma: no cover
    from config.env import VAR_DIR

    sys.exit(0 if run(base_url=sys.argv[1], refservice_url=sys.argv[2],
                      credentials_path=VAR_DIR / "demo-credentials.json") else 1)
