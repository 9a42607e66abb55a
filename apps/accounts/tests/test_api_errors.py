"""Every error under /api/ is JSON, also when Django answers before DRF (a route that does not
match, a malformed id); pages keep their HTML error pages."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("path", ["/api/nope/", "/api/tasks/not-a-uuid/", "/api/tasks/not-a-uuid/actions/",
                                  "/api/approvals/123/decision/"])
def test_an_api_path_that_matches_no_route_is_a_json_404(client, admin_user, path):
    client.force_login(admin_user)
    resp = client.get(path)
    assert resp.status_code == 404
    assert resp["Content-Type"] == "application/json"
    assert resp.json() == {"error": "not_found", "detail": f"no such resource: {path}"}


def test_a_page_that_does_not_exist_keeps_its_html_404(client, admin_user):
    client.force_login(admin_user)
    resp = client.get("/tasks/not-a-uuid/")
    assert resp.status_code == 404 and resp["Content-Type"].startswith("text/html")
