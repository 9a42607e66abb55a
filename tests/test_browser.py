"""The three people's pages in a real browser: Playwright drives Debian's Chromium
(``/usr/bin/chromium``, installed by ``make browser``) against the live Django server, while an
agent thread runs the agent, tools, outbox and reconciler steps and the reference ticket service
answers over HTTP. Each test saves a screenshot under ``var/test-artifacts/screenshots/``.

* a requester files a request and watches it progress, live, to the answer and the ticket;
* an approver approves the proposal from the queue;
* an admin opens the task's trace and the metrics page;
* a requester answers the agent's question inline while the page polls (a regression a review found).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from apps.approvals.models import ApprovalPolicy, ApprovalRequest
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("FAULTDESK_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parent.parent / "var" / "test-artifacts" / "screenshots"
SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright

    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.fail(f"Debian's chromium is not installed at {CHROMIUM}: run `make browser` (as root) first")
    # Playwright's sync API keeps an asyncio loop on this thread while it runs; the tests' ORM calls
    # are still synchronous, which Django's async-safety check cannot tell (its documented switch).
    # Module scope: the loop ends, and the switch is put back, before the next module's tests.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM,
                                         args=["--headless", "--no-sandbox", "--disable-gpu"])
            yield browser
            browser.close()
    finally:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def agent():
    """Runs every open task's next steps in the background (what the Celery workers do)."""
    from django.db import connections

    stop = threading.Event()

    def loop() -> None:
        try:
            while not stop.is_set():
                for task_id in Task.objects.exclude(status__in=reducer.TERMINAL).values_list("id", flat=True):
                    drive(task_id, rounds=3)
                time.sleep(0.2)
        finally:
            connections.close_all()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(30)


#: What the browser reported the Content-Security-Policy blocked during the current test.
CSP_VIOLATIONS: list[str] = []


@pytest.fixture(autouse=True)
def _nothing_blocked_by_the_content_security_policy():
    """Every page works under the policy (base settings, django-csp): no script, style or
    connection of ours is refused by it in any browser test."""
    CSP_VIOLATIONS.clear()
    yield
    assert not CSP_VIOLATIONS, f"the Content-Security-Policy blocked: {CSP_VIOLATIONS}"


def _page(chromium, live_server, username: str):
    page = chromium.new_page(viewport={"width": 1280, "height": 1000})
    page.on("console", lambda m: CSP_VIOLATIONS.append(m.text) if "Content Security Policy" in m.text else None)
    page.set_default_timeout(30_000)
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", "pw-for-tests")
    page.click("main button[type=submit], main input[type=submit]")  # not the header's language chooser
    page.wait_for_url(lambda url: "/login/" not in url)
    return page


def _shot(page, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, "the screenshot holds a rendered page"
    return path


def test_a_requester_files_a_request_and_watches_it_reach_the_answer(chromium, live_server, agent, requester,
                                                                     device, kb, refservice):
    ApprovalPolicy.objects.create(tenant=device.tenant, version=2, rules={
        "tools": {"ticket.create": {"requires_approval": False, "ttl_minutes": 60}}})
    page = _page(chromium, live_server, "riley")
    page.click("text=New request")
    page.select_option("#id_device", str(device.pk))
    page.fill("#id_symptom", SYMPTOM)
    page.select_option("#id_urgency", "high")
    page.click("button:has-text('File request')")
    page.wait_for_url("**/tasks/*/")
    # The status section polls (htmx, every 2 s): the page moves on by itself to the answer.
    page.wait_for_selector(".status.s-COMPLETED", timeout=60_000)
    task = Task.objects.get(requester=requester)
    assert task.status == reducer.COMPLETED
    text = page.inner_text("#task-status")
    assert f"Ticket {task.state['receipt']['external_id']} created" in text
    assert "Laser Printer Fuser Error" in text  # a citation of the answer
    _shot(page, "requester-answer")


def test_a_requester_attaches_a_log_and_a_refused_file_keeps_the_report(chromium, live_server, requester, device):
    """The form's file field: a file that lies about its type is refused with its reason and the
    typed report stays; the log alone is then filed and listed on the request's page."""
    from tests.pdfmake import pdf_bytes

    log = b"08:00:09 ERROR E-203 fuser temperature below threshold\n"
    page = _page(chromium, live_server, "riley")
    page.click("text=New request")
    page.select_option("#id_device", str(device.pk))
    page.fill("#id_symptom", SYMPTOM)
    page.set_input_files("#id_attachments", files=[
        {"name": "printer.log", "mimeType": "text/plain", "buffer": log},
        {"name": "panel.png", "mimeType": "image/png", "buffer": pdf_bytes(["not a picture"])}])
    page.click("button:has-text('File request')")
    page.wait_for_selector("text=lies about its type")
    assert page.input_value("#id_symptom") == SYMPTOM and not Task.objects.exists()
    page.set_input_files("#id_attachments", files=[{"name": "printer.log", "mimeType": "text/plain", "buffer": log}])
    page.click("button:has-text('File request')")
    page.wait_for_url("**/tasks/*/")
    assert "printer.log" in page.inner_text("#task-status")
    _shot(page, "requester-attachment")


def test_an_approver_approves_the_proposal_from_the_queue(chromium, live_server, agent, requester, approver, device,
                                                          kb, refservice):
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    deadline = time.monotonic() + 60
    while Task.objects.get(pk=task.pk).status != reducer.WAITING_APPROVAL:
        assert time.monotonic() < deadline, Task.objects.get(pk=task.pk).status
        time.sleep(0.2)
    approval = ApprovalRequest.objects.get(task=task)
    page = _page(chromium, live_server, "avery")
    page.click("text=Approvals")
    row = page.locator(f"#approval-{approval.pk}")
    assert device.asset_tag in row.inner_text() and "Creates one ticket" in row.inner_text()
    row.locator("input[name=reason]").fill("matches the fuser procedure")
    row.locator("button[value=approve]").click()
    # htmx swaps the row in place with its decision
    page.wait_for_selector(f"#approval-{approval.pk} .status.s-APPROVED")
    _shot(page, "approver-queue")
    approval.refresh_from_db()
    assert approval.status == "APPROVED" and approval.decided_by.username == "avery"
    deadline = time.monotonic() + 60
    while Task.objects.get(pk=task.pk).status != reducer.COMPLETED:
        assert time.monotonic() < deadline, Task.objects.get(pk=task.pk).status
        time.sleep(0.2)


def test_an_admin_opens_the_trace_and_the_metrics_page(chromium, live_server, requester, approver, admin_user,
                                                       device, kb, refservice):
    from apps.approvals.services import approval_decide

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    page = _page(chromium, live_server, "adele")
    page.click("text=Traces")
    page.click(f"a[href='/tasks/{task.pk}/trace/']")
    page.wait_for_selector("svg.chart polyline")
    trace = page.inner_text("main")
    for etype in ("task.accepted", "evidence.retrieved", "model.called", "approval.granted", "intent.committed",
                  "receipt.recorded", "task.completed"):
        assert etype in trace
    _shot(page, "admin-trace")
    page.click("text=Metrics")
    page.wait_for_selector("h1:has-text('Metrics')")
    metrics = page.inner_text("main")
    assert "1 (0 open, 1 completed, 0 failed, 0 cancelled)" in metrics and "100 % of ended requests" in metrics
    _shot(page, "admin-metrics")
    # The Django admin under the same policy: the user page with its widgets and scripts.
    page.goto(f"{live_server.url}/django-admin/auth/user/{requester.pk}/change/")
    page.wait_for_selector("#user_form")
    page.goto(f"{live_server.url}/django-admin/devices/device/")
    page.wait_for_selector("#result_list")


def test_a_typed_answer_survives_the_live_polling(chromium, live_server, requester, device, kb):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom="broken").task.pk)
    assert task.status == reducer.WAITING_INPUT
    page = _page(chromium, live_server, "riley")
    page.goto(f"{live_server.url}/tasks/{task.pk}/")
    page.fill("#id_text", "Since Monday, after the firmware update; power-cycling did not help")
    page.focus("#id_text")
    page.wait_for_timeout(5000)  # two or three polls
    _shot(page, "review8-waiting-input")
    value = page.input_value("#id_text")
    assert value.startswith("Since Monday"), f"the typed answer was wiped by the 2 s poll: {value!r}"
    page.click("button:has-text('Send answer')")
    page.wait_for_selector("p.now")
    task = Task.objects.get(pk=task.pk)
    assert task.state["answers"] == ["Since Monday, after the firmware update; power-cycling did not help"]
    assert task.status == reducer.RETRIEVING  # re-planning with the answer; the live progress resumes


# --- the same three people's pages in Chinese ---------------------------------------------------

SYMPTOM_ZH = "机房 UPS A 电池自检失败，前面板“更换电池”指示灯亮，每 30 秒蜂鸣一次。"
#: the English headings and buttons of these pages: none may be left on a Chinese page
ENGLISH_UI = ("New request", "My requests", "Approvals", "Log out", "Answer", "Citations", "Proposal",
              "Confirmed change", "Status:", "Approve", "Reject", "File request", "Metrics", "Traces", "Language")


def _chinese_page(chromium, live_server, username: str, *, choose: bool = False):
    """A signed-in page in Chinese: by the browser's language (``zh-CN``), or — ``choose`` — by an
    English browser whose user picks 简体中文 in the chooser on the page."""
    page = chromium.new_page(viewport={"width": 1280, "height": 1000}, locale="en-US" if choose else "zh-CN")
    page.on("console", lambda m: CSP_VIOLATIONS.append(m.text) if "Content Security Policy" in m.text else None)
    page.set_default_timeout(30_000)
    page.goto(f"{live_server.url}/login/")
    assert ("登录" in page.inner_text("main")) != choose
    page.fill("#id_username", username)
    page.fill("#id_password", "pw-for-tests")
    page.click("main button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)
    if choose:
        page.select_option("header form.lang select[name=language]", "zh-hans")
        page.click("header form.lang button[type=submit]")
        page.wait_for_selector("html[lang=zh-hans]")
    return page


def _no_english_ui(page) -> None:
    text = page.inner_text("body")
    left = [s for s in ENGLISH_UI if s in text]
    assert not left, f"English left on a Chinese page: {left}"


def test_the_three_roles_pages_in_chinese(chromium, live_server, agent, requester, approver, admin_user, tenant,
                                         refservice):
    from apps.devices.models import Device
    from apps.evidence.services import document_ingest
    from tests.factories import DeviceFactory

    name = "ups-on-battery-and-battery-alarms.md"
    document_ingest(tenant=tenant, source=f"public/zh-CN/{name}",
                    raw=(Path(__file__).resolve().parent.parent / "apps" / "evidence" / "kb" / "public" / "zh-CN"
                         / name).read_text(), scope="public")
    ups = DeviceFactory(tenant=tenant, asset_tag="UPS-0007", name="机房 UPS A", kind="ups", state="degraded",
                        alert_code="UPS-BATT-017", alert_message="电池自检失败：B 组电压 11.2 V")
    assert Device.objects.filter(pk=ups.pk).exists()

    # The requester's browser speaks Chinese: the form, the live progress and the answer are Chinese.
    page = _chinese_page(chromium, live_server, "riley")
    page.click("header nav >> text=新建请求")
    page.select_option("#id_device", str(ups.pk))
    page.fill("#id_symptom", SYMPTOM_ZH)
    page.click("main button[type=submit]")
    page.wait_for_url("**/tasks/*/")
    page.wait_for_selector(".status.s-WAITING_APPROVAL", timeout=60_000)
    assert "等待审批" in page.inner_text("#task-status")
    _no_english_ui(page)
    _shot(page, "zh-requester-waiting")
    task = Task.objects.get(requester=requester)

    # The approver's browser is English; they choose 简体中文 on the page and approve in Chinese.
    page = _chinese_page(chromium, live_server, "avery", choose=True)
    page.click("header nav >> text=审批")
    approval = ApprovalRequest.objects.get(task=task)
    row = page.locator(f"#approval-{approval.pk}")
    row.locator("input[name=reason]").fill("与 UPS 电池告警规程一致")
    row.locator("button[value=approve]").click()
    page.wait_for_selector(f"#approval-{approval.pk} .status.s-APPROVED")
    assert "已批准" in row.inner_text()
    _no_english_ui(page)
    _shot(page, "zh-approver-queue")
    # The choice was saved: the approver's next page is Chinese though the browser asks for English.
    page.goto(f"{live_server.url}/approvals/")
    assert page.get_attribute("html", "lang") == "zh-hans"

    deadline = time.monotonic() + 60
    while Task.objects.get(pk=task.pk).status != reducer.COMPLETED:
        assert time.monotonic() < deadline, Task.objects.get(pk=task.pk).status
        time.sleep(0.2)

    # Back at the requester's page: the answer is Chinese and cites the Chinese procedure.
    page = _chinese_page(chromium, live_server, "riley")
    page.goto(f"{live_server.url}/tasks/{task.pk}/")
    text = page.inner_text("#task-status")
    assert "已完成" in text and "现在怎么做" in text and "UPS 电池供电事件及电池健康告警" in text
    assert f"工单 {Task.objects.get(pk=task.pk).state['receipt']['external_id']}" in text
    _no_english_ui(page)
    _shot(page, "zh-requester-answer")

    # The admin reads the trace and the metrics in Chinese.
    page = _chinese_page(chromium, live_server, "adele")
    page.click("header nav >> text=追踪")
    page.click(f"a[href='/tasks/{task.pk}/trace/']")
    page.wait_for_selector("svg.chart polyline")
    assert "task.completed" in page.inner_text("main")  # event types are codes, the same in every language
    _no_english_ui(page)
    _shot(page, "zh-admin-trace")
    page.click("header nav >> text=指标")
    page.wait_for_selector("h1:has-text('指标')")
    _no_english_ui(page)
    _shot(page, "zh-admin-metrics")
