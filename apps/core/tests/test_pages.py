"""One renderer for the people's pages (apps/core/pages.py; DESIGN.md §1): a full page, or for an
htmx request that is not a history restore only its fragment, always with ``Vary: HX-Request``."""

from __future__ import annotations

import pytest
from django.test import RequestFactory
from django_htmx.middleware import HtmxDetails

from apps.core.pages import is_fragment_request, render_fragment, render_page


def _request(**headers):
    request = RequestFactory().get("/somewhere", headers=headers)
    request.htmx = HtmxDetails(request)
    return request


@pytest.mark.parametrize(("headers", "fragment"), [
    ({}, False),
    ({"HX-Request": "true"}, True),
    ({"HX-Request": "true", "HX-History-Restore-Request": "true"}, False),
])
def test_only_an_htmx_request_that_is_not_a_history_restore_gets_a_fragment(headers, fragment):
    assert is_fragment_request(_request(**headers)) is fragment


def test_a_request_without_the_htmx_middleware_gets_the_page():
    assert is_fragment_request(RequestFactory().get("/")) is False


#: a page that extends the base the renderer picks, its fragment, and the two bases
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "OPTIONS": {"loaders": [("django.template.loaders.locmem.Loader", {
        "page.html": "{% extends base_template %}{% block content %}page body{% endblock %}",
        "_part.html": "only the part",
        "base.html": "<html>{% block content %}{% endblock %}</html>",
        "_fragment.html": "{% block content %}{% endblock %}",
    })]},
}]


@pytest.fixture
def templates(settings):
    settings.TEMPLATES = TEMPLATES


def test_a_page_is_whole_and_an_htmx_request_gets_its_content_block(templates):
    page = render_page(_request(), "page.html", {})
    block = render_page(_request(**{"HX-Request": "true"}), "page.html", {})
    restore = render_page(_request(**{"HX-Request": "true", "HX-History-Restore-Request": "true"}), "page.html", {})
    assert page.content == b"<html>page body</html>" == restore.content
    assert block.content == b"page body"
    for response in (page, block, restore):
        assert "HX-Request" in response["Vary"]


def test_a_named_fragment_replaces_the_page_for_an_htmx_request(templates):
    part = render_page(_request(**{"HX-Request": "true"}), "page.html", {}, fragment="_part.html", status=422)
    page = render_page(_request(), "page.html", {}, fragment="_part.html")
    assert (part.status_code, part.content) == (422, b"only the part")
    assert page.content == b"<html>page body</html>"
    assert "HX-Request" in part["Vary"]


def test_a_fragment_answer_keeps_its_status_and_varies(templates):
    response = render_fragment(_request(**{"HX-Request": "true"}), "_part.html", {}, status=409)
    assert (response.status_code, response.content) == (409, b"only the part")
    assert "HX-Request" in response["Vary"]
