"""Production fails closed (config/settings/production.py, config/deploy_checks.py): it is the
default settings module of every entry point a deployment runs; ``check --deploy`` names every
missing or published development secret, DEBUG, and a missing host or origin, and is clean with
real values; a production web or worker process refuses to start while one fails; transport
security and the JSON-only API are on; every page carries a Content-Security-Policy."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent

REAL = {
    "DJANGO_SECRET_KEY": secrets.token_urlsafe(64),
    "DJANGO_ALLOWED_HOSTS": "faultdesk.example.com",
    "DJANGO_CSRF_TRUSTED_ORIGINS": "https://faultdesk.example.com",
    "DATABASE_URL": "postgres://fd:pw@db.invalid:5432/faultdesk",
    "REDIS_URL": "redis://redis.invalid:6379/0",
    "REFSERVICE_API_KEY": secrets.token_urlsafe(24),
    "REFSERVICE_WEBHOOK_SECRET": secrets.token_urlsafe(32),
    "HELPDESK_API_TOKEN": secrets.token_hex(20),
    "FAULTDESK_METRICS_TOKEN": secrets.token_urlsafe(24),
    "REFSERVICE_URL": "https://tickets.example.com",
    "HELPDESK_URL": "https://helpdesk.example.com",
    "EMAIL_HOST": "smtp.example.com",
    "FAULTDESK_PUBLIC_BASE_URL": "https://faultdesk.example.com",
}


def _run(args: list[str], env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``args`` with only ``env`` (and PATH/HOME) in the environment: no DJANGO_*, no
    secrets, and no development .env (``ENV_FILE=""``)."""
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "ENV_FILE": "",
             "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(args, cwd=cwd, env=clean, capture_output=True, text=True, timeout=120)  # noqa: S603


def test_check_deploy_with_no_secrets_exits_non_zero_naming_each_one():
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production"})
    assert done.returncode != 0
    for code, name in [("E001", "DJANGO_SECRET_KEY"), ("E003", "DJANGO_ALLOWED_HOSTS"),
                       ("E004", "DJANGO_CSRF_TRUSTED_ORIGINS"), ("E005", "DATABASE_URL"), ("E006", "CELERY_BROKER_URL"),
                       ("E007", "REFSERVICE_API_KEY"), ("E008", "REFSERVICE_WEBHOOK_SECRET"),
                       ("E009", "HELPDESK_API_TOKEN"), ("E011", "FAULTDESK_METRICS_TOKEN"), ("E018", "EMAIL_HOST"),
                       ("E019", "FAULTDESK_PUBLIC_BASE_URL")]:
        assert f"(faultdesk.{code}) {name}" in done.stderr, (code, done.stderr[-3000:])


def test_check_deploy_with_real_values_is_clean():
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **REAL})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "System check identified no issues (0 silenced)." in done.stdout


@pytest.mark.parametrize("name", ["DJANGO_SECRET_KEY", "REFSERVICE_API_KEY", "REFSERVICE_WEBHOOK_SECRET",
                                  "HELPDESK_API_TOKEN"])
def test_a_published_development_secret_is_refused(name):
    dev = settings.DEV_SECRETS[name]
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **REAL, name: dev})
    assert done.returncode != 0 and f"{name} is a published development value" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("env, problem", [
    ({"DJANGO_DEBUG": "1"}, "DEBUG is on"),
    ({"REFSERVICE_WEBHOOK_SECRET": "short-secret-16c"}, "REFSERVICE_WEBHOOK_SECRET is shorter than 32"),
    ({"DJANGO_SECRET_KEY": "k" * 20}, "DJANGO_SECRET_KEY is shorter than 50"),
    ({"DJANGO_ALLOWED_HOSTS": "*"}, "DJANGO_ALLOWED_HOSTS is not set"),
    ({"FAULTDESK_MODEL_PROVIDER": "openai_compatible"}, "FAULTDESK_MODEL_API_KEY is not set"),
    ({"DJANGO_SECRET_KEY": "x" * 50}, "DJANGO_SECRET_KEY has fewer than 8 distinct characters"),
    ({"REFSERVICE_API_KEY": "faultdesk-refservice-dev-key2"}, "built on a published development value"),
    ({"REFSERVICE_WEBHOOK_SECRET": "a" * 32}, "REFSERVICE_WEBHOOK_SECRET has fewer than 8 distinct"),
    ({"FAULTDESK_METRICS_TOKEN": "a"}, "FAULTDESK_METRICS_TOKEN is shorter than 16"),
    ({"DJANGO_CSRF_TRUSTED_ORIGINS": "http://faultdesk.example.com"}, "not https"),
    ({"DJANGO_SECURE_HSTS_SECONDS": "0"}, "HSTS is off"),
    ({"DJANGO_SECURE_SSL_REDIRECT": "false"}, "the https redirect is off"),
    ({"REFSERVICE_URL": "http://127.0.0.1:8765"}, "REFSERVICE_URL is not an https URL"),
    ({"HELPDESK_URL": ""}, "HELPDESK_URL is not set"),
    ({"FAULTDESK_MODEL_PROVIDER": "openai_compatible", "FAULTDESK_MODEL_API_KEY": secrets.token_urlsafe(20)},
     "FAULTDESK_MODEL_BASE_URL is not set"),
])
def test_each_unsafe_value_is_named(env, problem):
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **REAL, **env})
    assert done.returncode != 0 and problem in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("env, broker, coordination", [
    ({}, "redis://redis.invalid:6379/0", "RedisCache"),
    ({"CELERY_BROKER_URL": "amqp://fd:pw@rabbit.invalid:5672/faultdesk"}, "amqp://fd:pw@rabbit.invalid:5672/faultdesk",
     "RedisCache"),
    ({"CELERY_BROKER_URL": "amqp://fd:pw@rabbit.invalid:5672/faultdesk", "REDIS_URL": ""},
     "amqp://fd:pw@rabbit.invalid:5672/faultdesk", "DummyCache"),
])
def test_the_broker_is_celery_broker_url_else_redis_url(env, broker, coordination):
    """RabbitMQ carries the messages when CELERY_BROKER_URL says amqp://; Redis (REDIS_URL) keeps the
    coordination hints when it is there, and without it every commit sends (the dummy cache)."""
    code = ("import json; from django.conf import settings as s; print(json.dumps([s.CELERY_BROKER_URL, "
            "s.CACHES['coordination']['BACKEND'].rsplit('.', 1)[-1]]))")
    done = _run([sys.executable, "manage.py", "shell", "-c", code],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **REAL, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [broker, coordination]
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **REAL, **env})
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_deployment_entry_point_defaults_to_production(tmp_path):
    """With no DJANGO_SETTINGS_MODULE and no .env, manage.py and the Celery app run the
    production settings (the WSGI app: the next test)."""
    done = _run([sys.executable, str(ROOT / "manage.py"), "shell", "-c",
                 "from django.conf import settings; print(settings.SETTINGS_MODULE)"], {}, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split()[-1] == "config.settings.production", done.stderr[-2000:]
    done = _run([sys.executable, "-c", "import os, config.celery; print(os.environ['DJANGO_SETTINGS_MODULE'])"], {},
                cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.split() == ["config.settings.production"], done.stderr[-2000:]


def test_a_production_web_process_with_missing_secrets_refuses_to_start(tmp_path):
    done = _run([sys.executable, "-c", "import config.wsgi"], {}, cwd=tmp_path)
    assert done.returncode != 0
    assert "refusing to start" in done.stderr and "faultdesk.E001: DJANGO_SECRET_KEY is not set" in done.stderr
    done = _run([sys.executable, "-c", "import config.wsgi; print('started')"], REAL, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("started"), done.stderr[-2000:]


def test_production_transport_security_and_json_only_api():
    code = ("import json; from django.conf import settings as s; print(json.dumps({"
            "'hsts': s.SECURE_HSTS_SECONDS, 'sub': s.SECURE_HSTS_INCLUDE_SUBDOMAINS, 'redirect': s.SECURE_SSL_REDIRECT,"
            "'proxy': list(s.SECURE_PROXY_SSL_HEADER), 'cookies': [s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE],"
            "'origins': s.CSRF_TRUSTED_ORIGINS, 'renderers': s.REST_FRAMEWORK['DEFAULT_RENDERER_CLASSES'],"
            "'debug': s.DEBUG, 'script': s.CONTENT_SECURITY_POLICY['DIRECTIVES']['script-src']}))")
    done = _run([sys.executable, "-c", code], {"DJANGO_SETTINGS_MODULE": "config.settings.production", **REAL})
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"hsts": 31536000, "sub": True, "redirect": True, "proxy": ["HTTP_X_FORWARDED_PROTO", "https"],
                   "cookies": [True, True], "origins": ["https://faultdesk.example.com"],
                   "renderers": ["rest_framework.renderers.JSONRenderer"], "debug": False, "script": ["'self'"]}


def test_every_page_carries_a_content_security_policy(client, requester):
    client.force_login(requester)
    for path in ("/login/", "/", "/requests/"):
        csp = client.get(path)["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "object-src 'none'" in csp and "frame-ancestors 'none'" in csp, path


def test_a_credential_from_a_mounted_secret_file_passes_and_an_unreadable_one_is_named(tmp_path):
    """The tool gateway reads ``*_FILE`` (a mounted secret); the deploy checks read it the same way."""
    key = tmp_path / "refservice_api_key"
    key.write_text(secrets.token_urlsafe(24) + "\n")
    env = {k: v for k, v in REAL.items() if k != "REFSERVICE_API_KEY"}
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **env, "REFSERVICE_API_KEY_FILE": str(key)})
    assert done.returncode == 0, done.stderr[-2000:]
    done = _run([sys.executable, "manage.py", "check", "--deploy"],
                {"DJANGO_SETTINGS_MODULE": "config.settings.production", **env,
                 "REFSERVICE_API_KEY_FILE": str(tmp_path / "missing")})
    assert done.returncode != 0 and "REFSERVICE_API_KEY_FILE names a file that cannot be read" in done.stderr
