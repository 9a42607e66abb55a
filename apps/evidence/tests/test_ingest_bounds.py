"""Ingestion reads only what is inside the folder it was given, and only files of a bounded size:
a symbolic link leading out of the folder is reported and not followed, and a file over the
size limit is reported as unreadable; the rest of the run goes on."""

from __future__ import annotations

from apps.evidence import services
from apps.evidence.models import Chunk, Document

DOC = "# Printer jams\n\n## Steps\n\nOpen tray 2, remove the jammed sheet, close the tray and print a test page.\n"


def test_links_out_of_the_folder_and_oversized_files_are_not_read(tenant, tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.md").write_text("# Payroll\n\nThe root password is hunter2, rotate it monthly please.\n")
    kb = tmp_path / "kb"
    (kb / "public").mkdir(parents=True)
    (kb / "public" / "jams.md").write_text(DOC)
    (kb / "public" / "leak.md").symlink_to(outside / "secret.md")
    (kb / "public" / "big.md").write_text(DOC + "x" * 5000)
    monkeypatch.setattr(services, "MAX_SOURCE_BYTES", 1000)
    seen = []
    report = services.path_ingest(tenant=tenant, path=kb, scope="public",
                                  progress=lambda i, n, source, outcome: seen.append((source, outcome)))
    assert (report.created, report.failed) == (1, 2)
    outcomes = dict(seen)
    assert outcomes["kb/public/jams.md"] == "created"
    assert outcomes["kb/public/big.md"] == "failed: larger than 1000 bytes"
    leak = next(o for s, o in seen if s.endswith("leak.md") or s.endswith("secret.md"))
    assert "outside" in leak and "not followed" in leak
    assert list(Document.objects.values_list("source", flat=True)) == ["kb/public/jams.md"]
    assert not Chunk.objects.filter(text__contains="hunter2").exists()
