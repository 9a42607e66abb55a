"""PDF ingestion: a PDF is read with pypdf, chunked by page (each chunk's section names its page),
ingested like any other document — and re-ingesting it unchanged embeds nothing. An unreadable PDF
is reported and skipped; the rest of the run goes on."""

from __future__ import annotations

from apps.evidence import services
from apps.evidence.models import Chunk, Document
from apps.evidence.services import path_ingest
from tests.pdfmake import pdf_bytes

MANUAL = [
    "Fuser unit replacement\nTurn the printer off and let the fuser cool for 30 minutes before removing it.",
    "Reset the fuser counter\nAfter replacing the fuser, open the service menu and reset the fuser life counter.",
]


def test_a_pdf_is_chunked_by_page_and_reingesting_it_unchanged_embeds_nothing(tenant, tmp_path, monkeypatch):
    folder = tmp_path / "public"
    folder.mkdir()
    (folder / "lasermax-9050-service-manual.pdf").write_bytes(pdf_bytes(MANUAL, title="LaserMax 9050 service manual"))
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is not a pdf")
    calls = []
    real = services.embed_texts
    monkeypatch.setattr(services, "embed_texts", lambda texts: calls.append(len(texts)) or real(texts))
    seen = []
    report = path_ingest(tenant=tenant, path=folder, scope="public", progress=lambda *a: seen.append(a))

    assert (report.created, report.failed) == (1, 1)
    assert any(outcome.startswith("failed: not a readable PDF") and source.endswith("broken.pdf")
               for _, _, source, outcome in seen)
    doc = Document.objects.get(tenant=tenant)
    assert doc.title == "LaserMax 9050 service manual"
    chunks = list(Chunk.objects.filter(document_version__document=doc).order_by("ordinal"))
    assert [c.section.split(" › ")[-1] for c in chunks] == ["Page 1", "Page 2"]
    assert "cool for 30 minutes" in chunks[0].text and "life counter" in chunks[1].text
    assert calls == [2]

    again = path_ingest(tenant=tenant, path=folder, scope="public")
    assert (again.unchanged, again.chunks_embedded) == (1, 0) and calls == [2], "nothing re-embedded"


def test_a_changed_document_reembeds_only_its_changed_chunks_and_can_be_retired(tenant, tmp_path, monkeypatch):
    from django.core.management import call_command

    from apps.evidence.services import document_ingest

    calls = []
    real = services.embed_texts
    monkeypatch.setattr(services, "embed_texts", lambda texts: calls.append(list(texts)) or real(texts))
    raw = "# UPS alarms\n\n## Symptoms\n\nThe UPS beeps.\n\n## Procedure\n\nCheck the battery.\n"
    doc, outcome = document_ingest(tenant=tenant, source="public/ups.md", raw=raw, scope="public")
    assert (outcome, doc.embedded_chunks, len(calls[-1])) == ("created", 2, 2)
    changed = raw.replace("Check the battery.", "Check the battery and the input breaker.")
    doc, outcome = document_ingest(tenant=tenant, source="public/ups.md", raw=changed, scope="public")
    assert (outcome, doc.embedded_chunks) == ("updated", 1)
    assert len(calls) == 2 and len(calls[-1]) == 1 and "input breaker" in calls[-1][0], "only the changed chunk"
    current = Chunk.objects.filter(document_version__document=doc, is_current=True)
    assert current.count() == 2 and doc.current_version == 2

    call_command("ingest", retire="public/ups.md", tenant=tenant.slug)
    doc.refresh_from_db()
    assert doc.retired and not Chunk.objects.filter(document_version__document=doc, is_current=True).exists()
