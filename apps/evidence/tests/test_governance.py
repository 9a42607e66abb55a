"""Governance metadata as retrieval applies it: what is not evidence (unapproved, unpublished, not
yet in force, expired), what is cited with a "stale" mark, the human gate carried on each
reference, and the seed's documentation projection as an ingest format."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from apps.evidence.governance import MetadataInvalid, evidence_standing, front_matter_split, html_metadata
from apps.evidence.models import Chunk, Document
from apps.evidence.relevance import evidence_select
from apps.evidence.selectors import evidence_retrieve
from apps.evidence.services import document_ingest, path_ingest

SEED = Path(__file__).resolve().parent / "data" / "documentation-projection.json"
BODY = """# Pallet Wrapper Film Break Recovery

The stretch wrapper stops with a film break alarm when the film tears during a cycle.

## Alert codes

- WRAP-FILM-BRK-04: film break detected by the carriage dancer bar.

## Procedure

1. Press the emergency stop and lock out the turntable before reaching into the carriage.
2. Rethread the film through the pre-stretch rollers following the label on the carriage door.
3. Restart the cycle from the operator panel and watch the first two wraps.
"""


def _front(**fields) -> str:
    lines = ["---", "device_kinds: [stretch_wrapper]", "alert_codes: [WRAP-FILM-BRK-04]"]
    lines += [f"{k}: {v}" for k, v in fields.items()]
    return "\n".join([*lines, "---", ""]) + BODY


def _select(tenant, now=None):
    return evidence_select(tenant_id=tenant.pk, scopes=["public"], now=now,
                           report="the wrapper film keeps tearing halfway through the pallet",
                           device={"kind": "stretch_wrapper", "alert_code": "WRAP-FILM-BRK-04"})


@pytest.mark.django_db
def test_an_approved_published_document_in_force_is_evidence(tenant):
    document_ingest(tenant=tenant, source="public/wrap.md", raw=_front(governance_status="APPROVED"), scope="public")
    sel = _select(tenant)
    assert sel.outcome == "answered"
    assert {r.source for r in sel.refs} == {"public/wrap.md"}
    assert not any(r.stale for r in sel.refs)


@pytest.mark.django_db
@pytest.mark.parametrize("field, value, reason", [
    ("governance_status", "DRAFT", "not approved"),
    ("governance_status", "REJECTED", "not approved"),
    ("publication_status", "UNPUBLISHED", "not published"),
    ("publication_status", "WITHDRAWN", "not published"),
])
def test_an_unapproved_or_unpublished_document_is_not_evidence(tenant, field, value, reason):
    document_ingest(tenant=tenant, source="public/wrap.md", raw=_front(**{field: value}), scope="public")
    assert _select(tenant).outcome == "no_procedure"
    assert evidence_retrieve(tenant_id=tenant.pk, scopes=["public"], query="wrapper film break") == []
    doc = Document.objects.get(source="public/wrap.md")
    assert reason in evidence_standing(doc.metadata, now=timezone.now()).reason


@pytest.mark.django_db
def test_an_expired_document_is_not_evidence_but_was_before_it_expired(tenant):
    document_ingest(tenant=tenant, source="public/wrap.md", raw=_front(expires_at="2026-03-01"), scope="public")
    assert _select(tenant, now=datetime(2026, 12, 2, tzinfo=UTC)).outcome == "no_procedure"
    assert _select(tenant, now=datetime(2026, 2, 1, tzinfo=UTC)).outcome == "answered"
    doc = Document.objects.get(source="public/wrap.md")
    assert evidence_standing(doc.metadata, now=datetime(2026, 12, 2, tzinfo=UTC)).reason == "expired on 2026-03-01"


@pytest.mark.django_db
def test_a_document_not_yet_in_force_is_not_evidence_until_it_is(tenant):
    effective = timezone.now() + timedelta(days=10)
    document_ingest(tenant=tenant, source="public/wrap.md",
                    raw=_front(effective_at=effective.date().isoformat()), scope="public")
    assert _select(tenant).outcome == "no_procedure"
    assert _select(tenant, now=effective + timedelta(days=1)).outcome == "answered"


@pytest.mark.django_db
@pytest.mark.parametrize("fields, reason", [
    ({"review_due_at": "2026-06-30"}, "review was due on 2026-06-30"),
    ({"freshness_status": "STALE"}, "freshness STALE"),
])
def test_a_stale_document_is_cited_with_a_visible_mark(tenant, fields, reason):
    document_ingest(tenant=tenant, source="public/wrap.md", raw=_front(**fields), scope="public")
    sel = _select(tenant, now=datetime(2026, 12, 2, tzinfo=UTC))
    assert sel.outcome == "answered"
    assert sel.refs and all(r.stale and r.stale_reason == reason for r in sel.refs)


@pytest.mark.django_db
def test_the_human_gate_travels_with_every_reference(tenant):
    document_ingest(tenant=tenant, source="public/wrap.md", raw=_front(requires_human_gate="true"), scope="public")
    refs = _select(tenant).refs
    assert refs and all(r.requires_human_gate for r in refs)


@pytest.mark.django_db
def test_unreadable_front_matter_is_refused_and_writes_nothing(tenant):
    for raw in ("---\nexpires_at: next tuesday\n---\n" + BODY, "---\n[not, a, mapping]\n---\n" + BODY,
                "---\nalert_codes: {a: 1}\n---\n" + BODY):
        with pytest.raises(MetadataInvalid):
            document_ingest(tenant=tenant, source="public/wrap.md", raw=raw, scope="public")
    assert not Document.objects.exists() and not Chunk.objects.exists()


def test_front_matter_and_html_meta_tags_are_read():
    meta, body = front_matter_split("---\nowner: Ops\nalert_codes: [A-1, B-2]\n---\n# T\n\ntext\n")
    assert meta == {"owner": "Ops", "alert_codes": ["A-1", "B-2"]} and body == "# T\n\ntext\n"
    assert front_matter_split("# No front matter\n---\n") == ({}, "# No front matter\n---\n")
    html = ('<html><head><meta name="faultdesk:owner" content="Facilities &amp; Ops">'
            '<meta name="faultdesk:device_kinds" content="ups, pdu"><meta name="viewport" content="x"></head></html>')
    assert html_metadata(html) == {"owner": "Facilities & Ops", "device_kinds": ["ups", "pdu"]}


@pytest.mark.django_db
def test_the_seed_documentation_projection_ingests_as_one_governed_chinese_document(tenant, tmp_path):
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "projection.json").write_bytes(SEED.read_bytes())
    report = path_ingest(tenant=tenant, path=tmp_path / "seed", scope="public")
    assert (report.created, report.failed) == (1, 0)
    doc = Document.objects.get()
    assert doc.source == "seed/projection.json#MYRILUM-DOC-ARCH-016@0.1.0:zh-CN"
    assert (doc.doc_id, doc.locale, doc.requires_human_gate) == ("MYRILUM-DOC-ARCH-016", "zh-CN", True)
    assert (doc.governance_status, doc.publication_status, doc.freshness_status) == \
        ("APPROVED", "PUBLISHED_GLOBAL", "CURRENT")
    assert doc.owner == "Web3Capital Documentation Steward"
    assert doc.metadata["command_authority"] == "NONE"
    assert "grants no command authority" in doc.metadata["limitations"]
    chunks = list(Chunk.objects.filter(document_version__document=doc).order_by("ordinal"))
    assert [c.section for c in chunks] == ["这张图说什么", "从定义到可运行实例", "单次行动循环", "运行状态分支",
                                           "结束与提交", "出处"]
    assert chunks[0].text.startswith("## 这张图说什么")
    assert "Canonical URL" not in chunks[0].text  # the metadata header is stored as fields, not text
    # review was due on 2026-10-23: cited, with the stale mark
    standing = evidence_standing(doc.metadata, now=datetime(2026, 12, 2, tzinfo=UTC))
    assert standing.evidence and standing.stale and standing.reason == "review was due on 2026-10-23"
    # Chinese words reach the full-text leg (jieba): a Chinese question finds its section
    refs = evidence_retrieve(tenant_id=tenant.pk, scopes=["public"], query="执行尝试和外部操作怎么建模", k=3)
    assert refs and refs[0].section == "这张图说什么"
    # unchanged on a second run
    assert path_ingest(tenant=tenant, path=tmp_path / "seed", scope="public").unchanged == 1
