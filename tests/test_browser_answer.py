"""Browser: answering the agent's questions inline while the status section polls (kept from the
issue 8 review)."""

from __future__ import annotations

import pytest

from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.test_browser import _page, _shot, chromium  # noqa: F401 - fixtures

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_a_typed_answer_survives_the_live_polling(chromium, live_server, requester, device, kb):  # noqa: F811
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
    from apps.tasks.models import Task

    task = Task.objects.get(pk=task.pk)
    assert task.state["answers"] == ["Since Monday, after the firmware update; power-cycling did not help"]
    assert task.status == reducer.RETRIEVING  # re-planning with the answer; the live progress resumes
