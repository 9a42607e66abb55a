"""The demo's HTTP client: runs the main job through the public API exactly as people would —
the requester files a fault request, the approver approves the proposed ticket, and the client
waits for the receipt — then prints the answer, citations, ticket id and trace URL, and checks at
the ticket system itself that exactly one ticket (or comment) exists for the action's
idempotency key.

The key comes from the task's actions API (``GET /api/tasks/<id>/actions/``, admins), never from
an event payload: the events API shows sensitive payloads such as ``intent.committed`` as their
digest only.

Its last line on success is ``DEMO OK task=<task id> ticket=<external ticket id>``; on failure it
is ``DEMO FAILED: <why>`` and :func:`run` returns False.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

SYMPTOM = (
    "The 3rd floor MFP shows a fuser error right after warm-up and every page comes out with smeared, "
    "unfused toner. Power-cycling did not help."
)
#: the Chinese run's report (``language="zh-hans"``): the server-room UPS, which has a Chinese procedure
#: the log the English run attaches to its report (the fault lines reach retrieval as request data;
#: the file reaches the ticket once it exists)
DEMO_LOG_NAME = "printer-panel.log"
DEMO_LOG = (b"2026-12-05 08:00:01 INFO warm-up started\n"
            b"2026-12-05 08:00:09 ERROR fuser temperature below threshold during warm-up\n"
            b"2026-12-05 08:00:10 INFO retrying warm-up\n")

SYMPTOM_ZH = "机房 UPS A 电池自检失败，前面板“更换电池”指示灯亮，每 30 秒蜂鸣一次，担心停电时撑不住。"
#: the languages a demo run can speak: Accept-Language sent, and the approver's reason
LANGUAGES = {"en": ("en", "Matches the fuser procedure; go ahead."),
             "zh-hans": ("zh-Hans,zh;q=0.9", "与 UPS 电池告警规程一致，同意创建工单。")}


@dataclass(frozen=True)
class DemoTenant:
    """Who plays which part in one tenant of the demo data (``python -m tools.seed_demo``), and on which device."""

    requester: str
    approver: str
    admin: str
    device: str
    #: the device of the Chinese run (one whose procedure is written in Chinese), None: no Chinese run
    chinese_device: str | None = None


#: tenant slug → its demo cast. ``acme`` files in the reference ticket service, ``initech`` in
#: django-helpdesk (tools/demo_data.py seeds both).
TENANTS = {
    "acme": DemoTenant(requester="riley", approver="avery", admin="adele", device="PRN-0417",
                       chinese_device="UPS-0007"),
    "initech": DemoTenant(requester="ines", approver="ivan", admin="iris", device="PRN-0811"),
}


@dataclass(frozen=True)
class TicketSystems:
    """Where the demo checks the ticket system's own records, and with what credentials."""

    refservice_url: str = "http://127.0.0.1:8765"
    refservice_api_key: str = "faultdesk-refservice-dev-key"
    helpdesk_url: str = "http://127.0.0.1:8766"
    helpdesk_token: str = ""

    @classmethod
    def from_env(cls, **override: str) -> TicketSystems:
        """From ``REFSERVICE_URL``, ``REFSERVICE_API_KEY``, ``HELPDESK_URL`` and
        ``HELPDESK_API_TOKEN`` (the variables the web and workers read), then ``override``."""
        env = os.environ
        values = {"refservice_url": env.get("REFSERVICE_URL", cls.refservice_url),
                  "refservice_api_key": env.get("REFSERVICE_API_KEY", cls.refservice_api_key),
                  "helpdesk_url": env.get("HELPDESK_URL", cls.helpdesk_url),
                  "helpdesk_token": env.get("HELPDESK_API_TOKEN", cls.helpdesk_token)}
        return cls(**{**values, **override})


class DemoFailed(Exception):
    """The demo cannot go on; the message says why (printed as ``DEMO FAILED: …``)."""


def _say(msg: str) -> None:
    print(msg, flush=True)


def _json(resp: httpx.Response, what: str):
    """The JSON body of a 2xx response; DemoFailed naming ``what`` and the status otherwise."""
    if not resp.is_success:
        raise DemoFailed(f"{what}: {resp.request.method} {resp.request.url.path} answered {resp.status_code} "
                         f"{resp.text[:300]}")
    return resp.json()


def _poll(client: httpx.Client, task_id: str, until: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        task = _json(client.get(f"/api/tasks/{task_id}/"), "reading the task")
        if task["status"] != last:
            last = task["status"]
            _say(f"  … {last} (version {task['version']})")
        if task["status"] in until or task["status"] in {"FAILED", "CANCELLED"}:
            return task
        time.sleep(0.5)
    raise DemoFailed(f"task {task_id} did not reach {sorted(until)} within {timeout}s (last {last})")


def _sent_action(admin: httpx.Client, task: dict) -> dict:
    """The action whose receipt the task shows, from ``GET /api/tasks/<id>/actions/``."""
    receipt = task["receipt"]
    actions = _json(admin.get(f"/api/tasks/{task['id']}/actions/"), "reading the task's actions")
    sent = [a for a in actions if a["status"] == "SUCCEEDED" and a["external_id"] == receipt["external_id"]
            and a["compensates_id"] is None]
    if len(sent) != 1:
        raise DemoFailed(f"expected one succeeded action for receipt {receipt['external_id']}, "
                         f"the actions API lists {[(a['tool'], a['status'], a['external_id']) for a in actions]}")
    return sent[0]


def _page_as(base_url: str, login: tuple[str, str], url: str, headers: dict | None = None) -> httpx.Response:
    """GET the web page ``url`` signed in through the login form as ``login`` (username,
    password): pages take a session, not basic auth. ``headers``: sent with every request (e.g.
    ``Accept-Language``)."""
    headers = {k: v for k, v in (headers or {}).items() if k.lower() == "accept-language"}
    with httpx.Client(base_url=base_url, timeout=30, follow_redirects=True, headers=headers) as browser:
        form = browser.get("/login/")
        token = browser.cookies.get("csrftoken", "")
        browser.post("/login/", data={"username": login[0], "password": login[1], "csrfmiddlewaretoken": token},
                     headers={"Referer": str(form.url)})
        return browser.get(url)


def _held_at_ticket_system(systems: TicketSystems, receipt: dict, key: str) -> list[str]:
    """Ids of what the tenant's ticket system itself holds for idempotency key ``key``."""
    if receipt.get("connector", "reference") == "helpdesk":  # django-helpdesk: the key is a custom field
        found = httpx.get(f"{systems.helpdesk_url}/helpdesk/api/faultdesk/tickets/by-custom-field/",
                          params={"field": "faultdesk_key", "value": key}, timeout=10,
                          headers={"Authorization": f"Token {systems.helpdesk_token}"})
        return [str(t["id"]) for t in _json(found, "looking the key up at django-helpdesk")["results"]]
    auth = {"Authorization": f"Bearer {systems.refservice_api_key}"}
    if receipt.get("kind") == "comment":  # a second run comments on the first run's open ticket
        found = httpx.get(f"{systems.refservice_url}/tickets/{receipt['ticket_id']}/comments",
                          params={"idempotency_key": key}, timeout=10, headers=auth)
        return [str(c["comment"]["id"]) for c in _json(found, "looking the key up at the reference service")["results"]]
    found = httpx.get(f"{systems.refservice_url}/tickets", params={"idempotency_key": key}, timeout=10, headers=auth)
    return [str(t["id"]) for t in _json(found, "looking the key up at the reference service")["results"]]


def _attachments_at_ticket_system(systems: TicketSystems, receipt: dict, ticket: str, files: list[dict], *,
                                   timeout: float) -> list[str]:
    """Wait (up to ``timeout`` seconds) until ticket ``ticket`` holds each of ``files`` (the task's
    ``attachments``) exactly once at the tenant's ticket system; returns their names. Raises
    DemoFailed when one is missing at the end or held twice."""
    deadline = time.monotonic() + timeout
    while True:
        if receipt.get("connector", "reference") == "helpdesk":
            found = httpx.get(f"{systems.helpdesk_url}/helpdesk/api/faultdesk/tickets/{ticket}/attachments/",
                              timeout=10, headers={"Authorization": f"Token {systems.helpdesk_token}"})
            rows = _json(found, "listing the ticket's files")["results"]
            digests = [r["title"].rsplit("sha256:", 1)[-1] for r in rows]
        else:
            found = httpx.get(f"{systems.refservice_url}/tickets/{ticket}/attachments", timeout=10,
                              headers={"Authorization": f"Bearer {systems.refservice_api_key}"})
            digests = [r["sha256"] for r in _json(found, "listing the ticket's files")["results"]]
        wanted = [f["sha256"] for f in files]
        if any(digests.count(d) > 1 for d in wanted):
            raise DemoFailed(f"ticket {ticket} holds an attachment twice: {digests}")
        if all(d in digests for d in wanted):
            return [f["name"] for f in files]
        if time.monotonic() > deadline:
            raise DemoFailed(f"ticket {ticket} does not hold the report's attachments after {timeout:.0f} s")
        time.sleep(0.5)


def run(*, base_url: str, credentials_path: Path, tenant: str = "acme", systems: TicketSystems | None = None,
        timeout: float = 180.0, before_ok: Callable[[], None] | None = None, language: str = "en") -> bool:
    """Run the main job against a running faultdesk at ``base_url`` as ``tenant``'s demo cast
    (:data:`TENANTS`), with passwords from ``credentials_path`` (``python -m tools.seed_demo`` writes it).

    Returns True when the task completed with a receipt and the ticket system (``systems``,
    default :meth:`TicketSystems.from_env`) holds exactly one ticket or comment for the action's
    idempotency key; prints ``DEMO OK task=… ticket=…`` last. ``before_ok()`` runs just before
    that line (the launcher replays every task there); an exception from it propagates. Any other
    failure — a refused call, a task that fails, a timeout (``timeout`` seconds per wait) — prints
    ``DEMO FAILED: …`` and returns False. Raises KeyError for a tenant not in :data:`TENANTS`, or
    for a ``language`` not in :data:`LANGUAGES`.

    ``language="zh-hans"``: the cast speaks Chinese (``Accept-Language: zh-Hans``) and reports
    :data:`SYMPTOM_ZH` on the tenant's ``chinese_device``; the run also checks that an API refusal,
    the answer, a cited procedure and the requester's page come back in Chinese, and its last line
    is ``DEMO OK zh-hans task=… ticket=…``."""
    cast = TENANTS[tenant]
    accept, _reason = LANGUAGES[language]
    if language != "en" and cast.chinese_device is None:
        raise KeyError(f"tenant {tenant} has no device for a Chinese run")
    systems = systems or TicketSystems.from_env()
    creds = json.loads(credentials_path.read_text())
    clients = [httpx.Client(base_url=base_url, auth=(user, creds[user]), timeout=30,
                            headers={"Accept-Language": accept})
               for user in (cast.requester, cast.approver, cast.admin)]
    try:
        return _run(*clients, cast=cast, admin_login=(cast.admin, creds[cast.admin]), systems=systems,
                    timeout=timeout, before_ok=before_ok, language=language)
    except (DemoFailed, httpx.HTTPError) as exc:
        _say(f"DEMO FAILED: {exc}")
        return False
    finally:
        for c in clients:
            c.close()


def _has_chinese(text: str) -> bool:
    return any("\u4e00" <= ch <= "\u9fff" for ch in text or "")


def _run(requester: httpx.Client, approver: httpx.Client, admin: httpx.Client, *, cast: DemoTenant,
         admin_login: tuple[str, str], systems: TicketSystems, timeout: float,
         before_ok: Callable[[], None] | None, language: str = "en") -> bool:
    chinese = language != "en"
    tag, symptom = (cast.chinese_device, SYMPTOM_ZH) if chinese else (cast.device, SYMPTOM)
    devices = _json(requester.get("/api/devices/", params={"asset_tag": tag}), "finding the device")
    if not devices:
        raise DemoFailed(f"no device {tag} for {cast.requester}; run `python -m tools.seed_demo` first")
    device = devices[0]
    if device["asset_tag"] != tag:
        raise DemoFailed(f"asked for device {tag}, the API answered with {device['asset_tag']}")
    if chinese:
        refused = requester.post("/api/tasks/", json={"device_id": device["id"]})
        if refused.status_code != 400 or not _has_chinese(refused.text):
            raise DemoFailed(f"a report without a symptom should be refused in Chinese; got {refused.status_code} "
                             f"{refused.text[:200]}")
        _say(f"\n0. 中文 (zh-Hans): a report without a symptom → {refused.status_code} {refused.text[:120]}")
    _say(f"\n1. {cast.requester} files a fault request for {device['asset_tag']} ({device['name']}, "
         f"{device['state']}, alert {device['alert_code']}, object version {device['version']})")
    key = f"demo-{uuid.uuid4()}"
    body = {"device_id": device["id"], "symptom": symptom, "urgency": "high"}

    def file_it() -> httpx.Response:
        if chinese:
            return requester.post("/api/tasks/", json=body, headers={"Idempotency-Key": key})
        # the English run attaches the printer's log (multipart/form-data)
        return requester.post("/api/tasks/", data=body, headers={"Idempotency-Key": key},
                              files=[("attachments", (DEMO_LOG_NAME, DEMO_LOG, "text/plain"))])

    resp = file_it()
    task = _json(resp, "filing the request")
    again = _json(file_it(), "filing it again")
    if again["id"] != task["id"]:
        raise DemoFailed(f"the same Idempotency-Key made a second task {again['id']} beside {task['id']}")
    _say(f"   POST /api/tasks/ (Idempotency-Key {key}) → {resp.status_code}, task {task['id']}; "
         f"the same key again → the same task")
    for a in task.get("attachments") or []:
        _say(f"   attached {a['name']} ({a['content_type']}, {a['size']} bytes, sha256 {a['sha256'][:16]}…)")

    task = _poll(requester, task["id"], {"WAITING_APPROVAL", "COMPLETED"}, timeout)
    if task["status"] != "WAITING_APPROVAL":
        raise DemoFailed(f"task ended {task['status']}: {task['termination_reason']}")
    _approve(approver, task, who=cast.approver, reason=LANGUAGES[language][1])

    _say("\n3. waiting for the ticket system's receipt")
    task = _poll(requester, task["id"], {"COMPLETED"}, timeout)
    if task["status"] != "COMPLETED" or not task["receipt"]:
        raise DemoFailed(f"task ended {task['status']}: {task['termination_reason']}")
    return _finish(requester, admin, task, admin_login=admin_login, systems=systems, before_ok=before_ok,
                   language=language)


def _approve(approver: httpx.Client, task: dict, *, who: str, reason: str) -> None:
    """Step 2: the approver reads the task's pending approval and approves it with ``reason``."""

    pending = _json(approver.get("/api/approvals/", params={"status": "PENDING", "task": task["id"]}),
                    "listing the pending approvals")
    if not pending:
        raise DemoFailed(f"no pending approval for task {task['id']}")
    approval = pending[0]
    if approval["task_id"] != task["id"]:
        raise DemoFailed(f"asked for task {task['id']}'s pending approval, got one of task {approval['task_id']}")
    p = approval["params"]
    _say(f"\n2. {who} reviews the proposal: {approval['tool']} on {approval['device']} "
         f"({approval['object_type']} version {approval['object_version']}, policy v{approval['policy_version']})")
    if approval["tool"] == "ticket.comment":  # the device's faultdesk ticket is still open
        _say(f"   a comment on the open ticket {p['ticket_id']}, only while it is at version {p['if_match']} "
             f"· digest {approval['action_digest'][:16]}…")
    else:
        _say(f"   title: {p['title']}\n   priority: {p['priority']} · digest {approval['action_digest'][:16]}…")
    decision = approver.post(f"/api/approvals/{approval['id']}/decision/",
                             json={"decision": "approve", "reason": reason})
    _say(f"   POST /api/approvals/{approval['id']}/decision/ → {decision.status_code} "
         f"{_json(decision, 'approving')['status']}")


def _finish(requester: httpx.Client, admin: httpx.Client, task: dict, *, admin_login: tuple[str, str],
            systems: TicketSystems, before_ok: Callable[[], None] | None, language: str) -> bool:
    """Steps 4–5 of a completed ``task``: the answer, its citations, the trace, the ticket system's
    own record of the key; in a Chinese run, the answer and the pages in Chinese. Prints the
    ``DEMO OK`` line; DemoFailed otherwise."""
    answer = task["answer"]
    receipt = task["receipt"]
    ticket_id = receipt["external_id"]
    _say("\n4. the answer\n")
    _say(answer["knowledge"]["text"])
    citations = answer["knowledge"]["citations"]
    if not citations:
        raise DemoFailed("the answer cites no procedure, though the knowledge base holds one for this device")
    if language != "en":
        cites_chinese = any(_has_chinese(c["document_title"]) for c in citations)
        if not _has_chinese(answer["knowledge"]["text"]) or not cites_chinese:
            raise DemoFailed("the Chinese report's answer is not in Chinese or cites no Chinese procedure")
        page = _page_as(str(requester.base_url), admin_login, f"/tasks/{task['id']}/",
                        headers=dict(requester.headers))
        if page.status_code != 200 or 'lang="zh-hans"' not in page.text or "回执" not in page.text:
            raise DemoFailed(f"the request page did not come back in Chinese ({page.status_code})")
    _say("\n   citations:")
    for c in citations:
        _say(f"   [{c['n']}] {c['document_title']} — version {c['version']}, § {c['section']} ({c['source']})")
    _say(f"\n   {answer['status_note']}")
    trace = _page_as(str(admin.base_url), admin_login, task["links"]["trace"])
    if trace.status_code != 200 or task["id"] not in trace.text:
        raise DemoFailed(f"the trace link {task['links']['trace']} answered {trace.status_code} to the tenant's admin")
    _say(f"   trace: {task['links']['trace']}")

    action = _sent_action(admin, task)
    action_key = action["idempotency_key"]
    system = receipt.get("connector", "reference")
    what = "comment" if receipt.get("kind") == "comment" else "ticket"
    held = _held_at_ticket_system(systems, receipt, action_key)
    if held != [ticket_id]:
        raise DemoFailed(f"the {system} ticket system holds {held} for key {action_key}, expected [{ticket_id}]")
    _say(f"   the {system} ticket system holds exactly one {what} for key {action_key}: {ticket_id} "
         f"(sent {len(action['attempts'])} time(s), {action['tool']} {action['tool_version']})")
    if task.get("attachments"):
        ticket = receipt.get("ticket_id") or ticket_id
        held_files = _attachments_at_ticket_system(systems, receipt, ticket, task["attachments"], timeout=60)
        _say(f"   its ticket {ticket} holds the attached {', '.join(held_files)}, each once")
    _say("")
    if before_ok is not None:
        before_ok()
    label = "DEMO OK" if language == "en" else f"DEMO OK {language}"
    _say(f"{label} task={task['id']} ticket={ticket_id}")
    return True


if __name__ == "__main__":  # pragma: no cover
    from config.env import VAR_DIR

    sys.exit(0 if run(base_url=sys.argv[1], credentials_path=VAR_DIR / "demo-credentials.json",
                      tenant=sys.argv[2] if len(sys.argv) > 2 else "acme") else 1)
