"""Answering the agent's question on the request page: a refused answer says why and keeps what
was typed."""

from __future__ import annotations

import pytest
from django.urls import reverse

from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p


@pytest.mark.django_db
def test_an_answer_too_long_says_so_and_keeps_the_typed_text(client, requester, device, kb):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom="broken").task.pk)
    assert task.status == reducer.WAITING_INPUT
    client.force_login(requester)
    typed = "The fuser light blinks. " * 200  # 4,800 characters: over the 4,000 the form takes
    resp = client.post(reverse("task-input", args=[task.pk]), {"text": typed}, follow=True)
    html = resp.content.decode()
    assert "at most 4000 characters" in html and "Please write an answer." not in html
    assert "The fuser light blinks." in html  # the text is back in the form
