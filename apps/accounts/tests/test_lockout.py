"""Sign-in and API abuse (django-axes, DRF throttles, Django's password validators): from the
fifth wrong password for one account from one address, the right one is refused too — on the login page
and on HTTP Basic — until the cool-off; the account from another address, and other accounts, are
not affected; the API answers 429 with Retry-After past its rate; weak passwords are refused."""

from __future__ import annotations

import base64

import pytest
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from rest_framework.throttling import SimpleRateThrottle

LIMIT = 5


def _basic(user: str, password: str) -> dict:
    return {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def _login(client, user: str, password: str, ip: str = "10.0.0.1"):
    return client.post("/login/", {"username": user, "password": password}, REMOTE_ADDR=ip)


def test_the_login_page_locks_an_account_out_after_repeated_failures(client, requester, approver):
    codes = [_login(client, "riley", "wrong-password").status_code for _ in range(LIMIT)]
    assert codes == [200] * (LIMIT - 1) + [429]  # the form again, then the fifth failure locks out
    resp = _login(client, "riley", "pw-for-tests")
    assert resp.status_code == 429 and int(resp["Retry-After"]) == 15 * 60
    assert "too many failed sign-ins" in resp.content.decode()
    assert "_auth_user_id" not in client.session, "the right password got through during the lockout"
    # Another account from the same address, and the same account from another address, sign in.
    assert _login(client, "avery", "pw-for-tests").status_code == 302
    client.logout()
    assert _login(client, "riley", "pw-for-tests", ip="10.0.0.2").status_code == 302


def test_a_success_before_the_limit_resets_the_count(client, requester):
    for _ in range(LIMIT - 1):
        _login(client, "riley", "wrong-password")
    assert _login(client, "riley", "pw-for-tests").status_code == 302
    client.logout()
    for _ in range(LIMIT - 1):
        _login(client, "riley", "wrong-password")
    assert _login(client, "riley", "pw-for-tests").status_code == 302


def test_http_basic_on_the_api_locks_out_too(client, requester):
    codes = [client.get("/api/tasks/", REMOTE_ADDR="10.0.0.3", **_basic("riley", "wrong-password")).status_code
             for _ in range(LIMIT)]
    assert codes[:-1] == [403] * (LIMIT - 1) and codes[-1] == 429
    resp = client.get("/api/tasks/", REMOTE_ADDR="10.0.0.3", **_basic("riley", "pw-for-tests"))
    assert resp.status_code == 429 and resp.json()["error"] == "locked_out" and "Retry-After" in resp
    assert client.get("/api/tasks/", REMOTE_ADDR="10.0.0.4", **_basic("riley", "pw-for-tests")).status_code == 200


@pytest.fixture
def low_rates(monkeypatch):
    """The API's rates lowered for the test (DRF reads them once, at import)."""
    monkeypatch.setattr(SimpleRateThrottle, "THROTTLE_RATES", {"user": "5/minute", "anon": "3/minute"})


def test_a_signed_in_user_past_the_rate_gets_429_with_retry_after(client, requester, low_rates):
    client.force_login(requester)
    codes = [client.get("/api/devices/").status_code for _ in range(6)]
    assert codes == [200] * 5 + [429]
    resp = client.get("/api/devices/")
    assert resp.status_code == 429 and int(resp["Retry-After"]) > 0 and resp.json()["error"]


def test_an_anonymous_address_past_the_rate_gets_429(client, db, low_rates):
    codes = [client.get("/api/schema/", REMOTE_ADDR="10.0.0.9").status_code for _ in range(4)]
    assert codes == [200] * 3 + [429]
    assert client.get("/api/schema/", REMOTE_ADDR="10.0.0.10").status_code == 200  # per address


@pytest.mark.parametrize("password, why", [
    ("short1!", "too short"), ("password1234", "too common"), ("4815162342108", "entirely numeric"),
    ("riley.requester", "too similar"),
])
def test_weak_passwords_are_refused(requester, password, why):
    requester.email = "riley.requester@example.test"
    with pytest.raises(ValidationError, match=why):
        validate_password(password, user=requester)
    validate_password("Fuser-warmup-2026-ok", user=requester)


def test_a_client_sent_x_forwarded_for_does_not_escape_the_rate(client, db, low_rates):
    codes = [client.get("/api/schema/", REMOTE_ADDR="10.0.0.11", HTTP_X_FORWARDED_FOR=f"203.0.113.{i}").status_code
             for i in range(4)]
    assert codes == [200] * 3 + [429]


def test_behind_one_trusted_proxy_the_forwarded_address_is_the_client(client, requester, settings):
    from django.test import RequestFactory

    from apps.accounts.lockout import client_ip

    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
    request = RequestFactory().get("/", REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR="6.6.6.6, 198.51.100.7")
    assert client_ip(request) == "198.51.100.7"  # what the proxy saw, not what the client claimed
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 0}
    assert client_ip(request) == "10.0.0.1"
