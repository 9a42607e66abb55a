"""The session store (apps/accounts/sessions.py): Django's database sessions, read by a statement
written once — the same rows, the same expiry, the same sign-out."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.sessions.models import Session
from django.utils import timezone

from apps.accounts.sessions import SessionStore


def test_the_store_is_the_configured_engine_and_reads_what_it_saved(db):
    assert settings.SESSION_ENGINE == "apps.accounts.sessions"
    store = SessionStore()
    store["who"] = "维修 technician"
    store.save()
    again = SessionStore(session_key=store.session_key)
    assert again["who"] == "维修 technician"
    assert again.session_key == store.session_key


def test_an_expired_or_unknown_session_loads_empty_and_forgets_its_key(db):
    store = SessionStore()
    store["who"] = "x"
    store.save()
    Session.objects.filter(session_key=store.session_key).update(expire_date=timezone.now() - timedelta(seconds=1))
    expired = SessionStore(session_key=store.session_key)
    assert expired.load() == {}
    assert expired.session_key is None  # the next save makes a new key, never revives the old one
    unknown = SessionStore(session_key="k" * 32)
    assert unknown.load() == {} and unknown.session_key is None


def test_sign_out_ends_the_session_for_the_next_request(client, requester):
    client.force_login(requester)
    assert client.get("/requests/").status_code == 200
    key = client.session.session_key
    assert client.post("/logout/").status_code == 302
    assert not Session.objects.filter(session_key=key).exists()
    client.cookies[settings.SESSION_COOKIE_NAME] = key  # a copied cookie of the ended session
    resp = client.get("/requests/")
    assert resp.status_code == 302 and "login" in resp["Location"]
