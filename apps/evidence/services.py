"""Ingestion of knowledge documents (DESIGN.md §9).

A document is identified by (tenant, source). Re-ingesting unchanged content costs nothing; changed
content creates a new :class:`DocumentVersion` whose chunks are embedded and become current, while
the chunks of older versions stay (evidence references point at a version) but are no longer
retrieved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from django.db import connection, transaction

from apps.accounts.models import AccessScope, Tenant
from apps.evidence.chunking import UnreadableDocument, parse_document, read_source
from apps.evidence.embedding import embed_texts, model_configured
from apps.evidence.governance import (
    DATE_FIELDS,
    GOVERNANCE_APPROVED,
    PUBLISHED_PREFIX,
    MetadataInvalid,
    metadata_normalise,
)
from apps.evidence.models import Chunk, Document, DocumentVersion
from apps.evidence.projection import projection_documents
from apps.evidence.textsearch import segmented

SUPPORTED_SUFFIXES = (".md", ".txt", ".html", ".htm", ".pdf", ".json")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class IngestReport:
    """Counts of one ingestion run."""

    created: int = 0
    updated: int = 0
    unchanged: int = 0
    chunks_embedded: int = 0
    #: files that could not be read (each reported through ``progress`` with its reason)
    failed: int = 0


def _digest(text: str, metadata: dict) -> str:
    """A version's digest: its text and, when it has any, its governance metadata (a change of
    status or dates is a new version, so a citation says which metadata it was made under)."""
    import rfc8785

    if metadata == metadata_normalise({}, text=text):
        return sha256_text(text)  # no metadata of its own: the digest of earlier builds
    return sha256_text(text + "\n" + rfc8785.dumps(metadata).decode())


#: Document columns copied from the normalised metadata
_DOCUMENT_FIELDS = ("doc_id", "locale", "owner", "governance_status", "publication_status", "freshness_status",
                    "effective_at", "expires_at", "last_verified_at", "review_due_at", "safety_class",
                    "requires_human_gate", "device_kinds", "alert_codes")


def document_ingest(*, tenant: Tenant, source: str, raw: str, scope: str,
                    parse_as: str | None = None) -> tuple[Document, str]:
    """Ingest one document's text with its governance metadata (front matter; see
    :mod:`apps.evidence.governance`). Returns ``(document, outcome)`` with outcome ``"created"``,
    ``"updated"`` or ``"unchanged"``; ``document.embedded_chunks`` says how many chunks were
    embedded (an unchanged document: none; an updated one: only its new or changed chunks).
    ``parse_as``: the file name whose extension says how to parse ``raw`` (default ``source``).

    Raises ``ValueError`` for an unknown scope, a document without text or metadata that cannot be
    read (:class:`~apps.evidence.governance.MetadataInvalid`).
    """
    if scope not in AccessScope.values:
        raise ValueError(f"unknown scope {scope!r}; expected one of {AccessScope.values}")
    parsed = parse_document(parse_as or source, raw)
    if not parsed.chunks:
        raise ValueError(f"{source}: no text to ingest")
    meta = metadata_normalise(parsed.metadata, text=parsed.text)
    digest = _digest(parsed.text, meta)
    existing = Document.objects.filter(tenant=tenant, source=source).first()
    if existing is not None and not existing.retired:
        current = existing.versions.filter(version=existing.current_version).first()
        if current is not None and current.content_digest == digest and existing.scope == scope:
            return existing, "unchanged"
    # Embed outside the transaction: it is the slow part and touches no rows. Only chunks whose
    # embedded text is new are embedded; an unchanged chunk of the previous version keeps its vector.
    inputs = [f"{parsed.title}. {c.section}. {c.text}" for c in parsed.chunks]
    model = model_configured()
    known = _previous_vectors(existing, model=model)
    missing = [t for t in dict.fromkeys(inputs) if sha256_text(t) not in known]
    fresh = dict(zip(missing, embed_texts(missing), strict=True)) if missing else {}
    vectors = [fresh[t] if t in fresh else known[sha256_text(t)] for t in inputs]
    with transaction.atomic():
        if existing is None:
            document = Document.objects.create(tenant=tenant, source=source, title=parsed.title[:300], scope=scope)
            outcome = "created"
        else:
            document = Document.objects.select_for_update().get(pk=existing.pk)
            outcome = "updated"
        version = DocumentVersion.objects.create(
            document=document, version=document.current_version + 1, content_digest=digest, content=parsed.text,
            metadata=meta,
        )
        governed = meta["governance_status"] == GOVERNANCE_APPROVED and \
            meta["publication_status"].startswith(PUBLISHED_PREFIX)
        Chunk.objects.filter(document_version__document=document, is_current=True).update(is_current=False)
        Chunk.objects.bulk_create(
            [
                Chunk(
                    document_version=version,
                    tenant=tenant,
                    scope=scope,
                    is_current=True,
                    ordinal=spec.ordinal,
                    section=spec.section[:300],
                    start_offset=spec.start,
                    end_offset=spec.end,
                    text=spec.text,
                    content_digest=sha256_text(spec.text),
                    embedding=vector,
                    embedding_model=model,
                    locale=meta["locale"],
                    governed=governed,
                    effective_at=meta["effective_at"],
                    expires_at=meta["expires_at"],
                    device_kinds=meta["device_kinds"],
                    alert_codes=meta["alert_codes"],
                )
                for spec, vector in zip(parsed.chunks, vectors, strict=True)
            ]
        )
        _index_text(version)
        document.title = parsed.title[:300]
        document.scope = scope
        document.retired = False
        document.current_version = version.version
        for name in _DOCUMENT_FIELDS:
            value = meta[name]
            setattr(document, name, "" if value is None and name not in DATE_FIELDS else value)
        document.metadata = meta
        document.save(update_fields=["title", "scope", "retired", "current_version", "metadata", "updated_at",
                                     *_DOCUMENT_FIELDS])
    document.embedded_chunks = len(missing)  # how many chunks this call embedded (the rest were reused)
    return document, outcome


def _index_text(version: DocumentVersion) -> None:
    """Set the full-text vectors of ``version``'s chunks: the section (weight A) and text (B) in
    the ``english`` configuration, and their Chinese words (:mod:`apps.evidence.textsearch`, B) in
    the ``simple`` one."""
    rows = list(Chunk.objects.filter(document_version=version).values_list("pk", "section", "text"))
    ids = [r[0] for r in rows]
    cjk = [segmented(f"{r[1]} {r[2]}") for r in rows]
    with connection.cursor() as cur:
        cur.execute(
            """
            UPDATE evidence_chunk c SET search_vector =
                setweight(to_tsvector('english', c.section), 'A') || setweight(to_tsvector('english', c.text), 'B')
                || setweight(to_tsvector('simple', u.words), 'B')
            FROM unnest(%s::bigint[], %s::text[]) AS u(id, words) WHERE c.id = u.id
            """,
            [ids, cjk],
        )


def _previous_vectors(document: Document | None, *, model: str) -> dict[str, list[float]]:
    """``{sha256 of the embedded text: vector}`` of the document's current chunks embedded by
    ``model`` (empty for a new or retired document), so an updated version re-embeds only its
    changed chunks."""
    if document is None or document.retired:
        return {}
    rows = Chunk.objects.filter(document_version__document=document, is_current=True, embedding_model=model,
                                embedding__isnull=False).values_list("section", "text", "embedding")
    return {sha256_text(f"{document.title}. {section}. {text}"): list(vector) for section, text, vector in rows}


def chunks_reembed(*, batch: int = 256, progress: Callable[[int, int], None] | None = None) -> int:
    """Embed every chunk (current or not, every tenant) whose vector is missing or was made by
    another model than :func:`~apps.evidence.embedding.model_configured`, in batches of
    ``batch``. Returns the number of chunks embedded; ``progress(done, total)`` after each batch."""
    model = model_configured()
    stale = Chunk.objects.exclude(embedding_model=model) | Chunk.objects.filter(embedding__isnull=True)
    ids = list(stale.order_by("pk").values_list("pk", flat=True))
    done = 0
    for start in range(0, len(ids), batch):
        rows = list(Chunk.objects.filter(pk__in=ids[start:start + batch])
                    .select_related("document_version__document").order_by("pk"))
        vectors = embed_texts([f"{c.document_version.document.title}. {c.section}. {c.text}" for c in rows])
        with transaction.atomic():
            for c, v in zip(rows, vectors, strict=True):
                Chunk.objects.filter(pk=c.pk).update(embedding=v, embedding_model=model)
        done += len(rows)
        if progress:
            progress(done, len(ids))
    return done


def document_retire(*, tenant: Tenant, source: str) -> Document:
    """Retire a document: its chunks stop being retrieved (``is_current`` off), its versions stay
    for the evidence that cites them (the evidence view says "retired"). Ingesting it again
    brings it back as a new version. Raises ``Document.DoesNotExist``."""
    with transaction.atomic():
        document = Document.objects.for_tenant(tenant.pk).select_for_update().get(source=source)
        Chunk.objects.filter(document_version__document=document, is_current=True).update(is_current=False)
        document.retired = True
        document.save(update_fields=["retired", "updated_at"])
    return document


#: The largest source file ingestion reads (bytes); a bigger one is reported as unreadable.
MAX_SOURCE_BYTES = 20 * 1024 * 1024


def _iter_files(path: Path) -> Iterable[tuple[Path, str | None]]:
    """``(file, problem)`` for each supported file under ``path``: ``problem`` is None, or why the
    file is not read — a link (or a file reached through one) that leads outside ``path``."""
    if path.is_file():
        yield path, None
        return
    root = path.resolve()
    for p in sorted(path.rglob("*")):
        if not (p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES and p.name.lower() != "readme.md"):
            continue
        target = p.resolve()
        yield p, (None if target.is_relative_to(root) else f"a link to {target}, outside {root}: not followed")


def _read_capped(file: Path) -> bytes:
    """The bytes of ``file``, at most :data:`MAX_SOURCE_BYTES`; raises :class:`UnreadableDocument`
    for a bigger one (read no further than the limit, whatever the file system says its size is)."""
    limit = MAX_SOURCE_BYTES
    with file.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise UnreadableDocument(f"larger than {limit} bytes")
    return data


def source_name(path: Path, root: Path) -> str:
    """The stable source name of ``path``: relative to ``root``'s parent (so ``kb/public/x.md``)."""
    try:
        return str(path.resolve().relative_to(root.resolve().parent))
    except ValueError:
        return str(path.resolve())


def path_ingest(
    *, tenant: Tenant, path: Path, scope: str, progress: Callable[[int, int, str, str], None] | None = None
) -> IngestReport:
    """Ingest every ``.md``/``.txt``/``.html``/``.pdf`` file under ``path`` (a README.md is skipped)
    with ``scope``. ``progress(i, n, source, outcome)`` is called after each file; a file that
    cannot be read — unreadable, over :data:`MAX_SOURCE_BYTES`, or a symbolic link leading out of
    ``path`` — is counted in ``failed`` and reported with its reason, and the run goes on.

    Raises ``FileNotFoundError`` when ``path`` does not exist and ``ValueError`` for a bad scope.
    """
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if scope not in AccessScope.values:
        raise ValueError(f"unknown scope {scope!r}; expected one of {AccessScope.values}")
    files = list(_iter_files(path))
    report = IngestReport()
    for i, (file, problem) in enumerate(files, start=1):
        source = source_name(file, path if path.is_dir() else path.parent)
        try:
            if problem:
                raise UnreadableDocument(problem)
            if file.suffix.lower() == ".json":
                # A documentation projection: one file, one document per doc_id@version:locale.
                items = [(f"{source}#{d.key}", d.markdown, f"{d.key}.md")
                         for d in projection_documents(_read_capped(file))]
            else:
                items = [(source, read_source(file.name, _read_capped(file)), source)]
        except (UnreadableDocument, MetadataInvalid) as exc:
            report.failed += 1
            if progress:
                progress(i, len(files), source, f"failed: {exc}")
            continue
        for item_source, raw, parse_as in items:
            try:
                document, outcome = document_ingest(tenant=tenant, source=item_source, parse_as=parse_as,
                                                    raw=raw.replace("\x00", ""), scope=scope)
            except ValueError as exc:  # e.g. no text to ingest, unreadable front matter (MetadataInvalid)
                report.failed += 1
                if progress:
                    progress(i, len(files), item_source, f"failed: {exc}")
                continue
            setattr(report, outcome, getattr(report, outcome) + 1)
            report.chunks_embedded += getattr(document, "embedded_chunks", 0)
            if progress:
                progress(i, len(files), item_source, outcome)
    return report
