"""The language each person sees (apps/accounts/language.py): the signed-in user's saved choice,
else the language cookie, else Accept-Language, else English; the chooser on every page saves the
choice, refuses an unknown language without changing anything, and never redirects off the site."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse

from apps.accounts.language import SESSION_KEY, supported
from apps.accounts.models import LanguagePreference

ZH = {"HTTP_ACCEPT_LANGUAGE": "zh-CN,zh;q=0.9,en;q=0.5"}
EN = {"HTTP_ACCEPT_LANGUAGE": "en-US,en;q=0.9"}


def test_supported_reads_codes_case_and_underscore_insensitively():
    assert supported("zh-Hans") == "zh-hans"
    assert supported("zh_Hans") == "zh-hans"
    assert supported(" EN ") == "en"
    assert supported("fr") is None and supported("") is None and supported(None) is None
    assert supported(["en"]) is None


@pytest.mark.django_db
def test_accept_language_chooses_chinese_for_a_visitor_and_english_otherwise():
    page = Client().get(reverse("login"), **ZH)
    assert page.status_code == 200
    assert page["Content-Language"] == "zh-hans"
    html = page.content.decode()
    assert '<html lang="zh-hans">' in html and "语言" in html
    english = Client().get(reverse("login"), **EN)
    assert english["Content-Language"] == "en" and '<html lang="en">' in english.content.decode()
    assert Client().get(reverse("login"))["Content-Language"] == "en"  # no header: English


@pytest.mark.django_db
def test_the_chooser_saves_the_choice_and_it_wins_over_accept_language(requester):
    client = Client()
    client.force_login(requester)
    resp = client.post(reverse("language-set"), {"language": "zh-hans", "next": "/requests/"}, **EN)
    assert resp.status_code == 302 and resp["Location"] == "/requests/"
    assert resp.cookies[settings.LANGUAGE_COOKIE_NAME].value == "zh-hans"
    assert LanguagePreference.objects.get(user=requester).language == "zh-hans"
    page = client.get("/requests/", **EN)
    assert page["Content-Language"] == "zh-hans" and "我的请求" in page.content.decode()

    # Another browser, English everywhere, no cookie: the saved choice follows the user at sign-in.
    elsewhere = Client()
    elsewhere.force_login(requester)
    assert elsewhere.session[SESSION_KEY] == "zh-hans"
    assert elsewhere.get("/requests/", **EN)["Content-Language"] == "zh-hans"

    # Back to English: saved, and the next page is English again even with a Chinese browser.
    elsewhere.post(reverse("language-set"), {"language": "en", "next": "/requests/"})
    assert LanguagePreference.objects.get(user=requester).language == "en"
    assert elsewhere.get("/requests/", **ZH)["Content-Language"] == "en"


@pytest.mark.django_db
def test_a_visitors_choice_is_a_cookie_only():
    client = Client()
    resp = client.post(reverse("language-set"), {"language": "zh-hans", "next": "/login/"}, **EN)
    assert resp.status_code == 302 and resp["Location"] == "/login/"
    assert client.get("/login/", **EN)["Content-Language"] == "zh-hans"
    assert not LanguagePreference.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["fr", "", "zh-hans<script>", "en" * 40, "\x00"])
def test_an_unknown_language_is_a_clear_400_that_changes_nothing(requester, value):
    client = Client()
    client.force_login(requester)
    resp = client.post(reverse("language-set"), {"language": value, "next": "/requests/"}, **ZH)
    assert resp.status_code == 400
    # a NUL byte is refused before the view by the site-wide check, with its own message
    assert ("en, zh-hans" if "\x00" not in value else "NUL") in resp.content.decode()
    assert settings.LANGUAGE_COOKIE_NAME not in resp.cookies
    assert not LanguagePreference.objects.exists()
    assert SESSION_KEY not in client.session


@pytest.mark.django_db
@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/x", "/\\evil.example",
                                    "javascript:alert(1)"])
def test_the_chooser_never_redirects_off_the_site(target):
    resp = Client().post(reverse("language-set"), {"language": "en", "next": target})
    assert resp.status_code == 302 and resp["Location"] == "/"


@pytest.mark.django_db
def test_the_chooser_takes_posts_only():
    resp = Client().get(reverse("language-set"), **ZH)
    assert resp.status_code == 405 and resp["Allow"] == "POST" and "语言" in resp.content.decode()


@pytest.mark.django_db
def test_every_page_carries_the_chooser(requester, approver, admin_user):
    for user, url in ((None, "/login/"), (requester, "/requests/"), (approver, "/approvals/"),
                      (admin_user, "/admin-tasks/")):
        client = Client()
        if user is not None:
            client.force_login(user)
        html = client.get(url).content.decode()
        assert f'action="{reverse("language-set")}"' in html, url
        assert 'value="zh-hans"' in html and "简体中文" in html, url


@pytest.mark.django_db
def test_api_errors_follow_the_language(requester):
    client = Client()
    client.force_login(requester)
    resp = client.post("/api/tasks/", {}, content_type="application/json", **ZH)
    assert resp.status_code == 400
    assert resp["Content-Language"] == "zh-hans"
    assert "该字段是必填项。" in resp.content.decode()
    resp = client.post("/api/tasks/", {}, content_type="application/json", **EN)
    assert "This field is required." in resp.content.decode()


@pytest.mark.django_db
def test_http_basic_on_the_api_answers_in_the_users_saved_language(requester):
    import base64
    import uuid

    requester.set_password("pw-basic")
    requester.save()
    LanguagePreference.objects.create(user=requester, language="zh-hans")
    auth = "Basic " + base64.b64encode(b"riley:pw-basic").decode()
    resp = Client().get(f"/api/tasks/{uuid.uuid4()}/", HTTP_AUTHORIZATION=auth, **EN)
    assert resp.status_code == 404
    assert resp["Content-Language"] == "zh-hans"
    assert resp.json()["error"] == "not_found"
    LanguagePreference.objects.filter(user=requester).delete()
    english = Client().get(f"/api/tasks/{uuid.uuid4()}/", HTTP_AUTHORIZATION=auth, **EN)
    assert english["Content-Language"] == "en" and english.json()["detail"] != resp.json()["detail"]


@pytest.mark.django_db
def test_error_pages_speak_the_readers_language_and_carry_the_chooser(requester, approver):
    client = Client()
    client.force_login(approver)
    forbidden = client.get(reverse("request-new"), **ZH)  # an approver may not file requests
    assert forbidden.status_code == 403
    html = forbidden.content.decode()
    assert "不允许" in html and 'action="/language/"' in html and '<html lang="zh-hans">' in html
    missing = client.get("/tasks/00000000-0000-0000-0000-000000000000/", **ZH)
    assert missing.status_code == 404 and "未找到" in missing.content.decode()
    assert "Not found" in client.get("/tasks/00000000-0000-0000-0000-000000000000/", **EN).content.decode()


def test_the_catalogue_check_warns_when_a_catalogue_is_not_compiled(tmp_path, settings):
    from apps.accounts.language import catalogues_compiled

    po = tmp_path / "xx" / "LC_MESSAGES" / "django.po"
    po.parent.mkdir(parents=True)
    po.write_text('msgid ""\nmsgstr ""\n')
    settings.LOCALE_PATHS = [tmp_path]
    assert [w.id for w in catalogues_compiled()] == ["faultdesk.W101"]
    po.with_suffix(".mo").write_bytes(b"")
    assert catalogues_compiled() == []


@pytest.mark.django_db
def test_the_django_admin_names_the_apps_and_models_in_the_readers_language(admin_user):
    client = Client()
    client.force_login(admin_user)
    zh = client.get("/django-admin/", **ZH).content.decode()
    assert "审批策略" in zh and "工单与服务级别" in zh and "SLA 策略" in zh
    en = client.get("/django-admin/", **EN).content.decode()
    assert "Approval policies" in en and "Approval policys" not in en
