"""The documentation projection as an ingest format (the seed ``documentation-projection.json``).

A projection file is a JSON array of section chunks, each carrying its document's identity
(``doc_id``, ``version``, ``locale``), its section (``section_title``, ``anchor``, ``citation_id``,
``canonical_url``) and the governance fields (see :mod:`apps.evidence.governance`). Each chunk's
``text`` opens with a header repeating those fields ("Document: …", "Region: …", …) and then holds
the section as ``<section_title>: <content>``.

:func:`projection_documents` groups the chunks by document and writes each document as Markdown
with front matter — its title as ``#``, each section as ``##`` with the section's own content — so
it is chunked, governed and cited like any other document, one chunk per section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import yaml

from apps.evidence.governance import FIELDS, MetadataInvalid

#: chunk keys carried to the document's front matter besides the governance fields
_KEEP = ("title", "region", "visibility", "authorization_scope", "content_maturity", "approvers", "source_refs")


@dataclass(frozen=True)
class ProjectedDocument:
    """One document of a projection: ``key`` (``doc_id@version:locale``) and its Markdown."""

    key: str
    markdown: str


def _section_content(chunk: dict) -> str:
    """The section's own text: what follows ``<section_title>:`` in the chunk text (the lines
    before it repeat the metadata), else the whole text."""
    text, title = str(chunk.get("text", "")), str(chunk.get("section_title", "")).strip()
    if title:
        marker = f"\n{title}:"
        at = text.find(marker)
        if at >= 0:
            return text[at + len(marker):].strip()
        if text.startswith(f"{title}:"):
            return text[len(title) + 1:].strip()
    return text.strip()


def projection_documents(data: bytes | str) -> list[ProjectedDocument]:
    """The documents of a projection file, in the order they first appear. Raises
    :class:`~apps.evidence.governance.MetadataInvalid` for a file that is not a JSON array of
    chunk objects with ``doc_id`` and ``text``."""
    try:
        items = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MetadataInvalid(f"not a JSON documentation projection: {exc}") from exc
    if not isinstance(items, list) or not items:
        raise MetadataInvalid("a documentation projection is a non-empty JSON array of section chunks")
    groups: dict[str, list[dict]] = {}
    for i, chunk in enumerate(items):
        if not isinstance(chunk, dict) or not chunk.get("doc_id") or not isinstance(chunk.get("text"), str):
            raise MetadataInvalid(f"chunk {i}: needs doc_id and text")
        key = f"{chunk['doc_id']}@{chunk.get('version') or '0'}:{chunk.get('locale') or 'und'}"
        groups.setdefault(key, []).append(chunk)
    out = []
    for key, chunks in groups.items():
        first = chunks[0]
        meta = {k: first[k] for k in FIELDS if first.get(k) is not None and k != "citation_id"}
        meta["doc_version"] = str(first.get("version") or "")
        meta.update({k: first[k] for k in _KEEP if first.get(k) is not None})
        meta["sections"] = [{"title": c.get("section_title", ""), "anchor": c.get("anchor", ""),
                             "citation_id": c.get("citation_id", ""), "canonical_url": c.get("canonical_url", ""),
                             "content_digest": c.get("content_digest", "")} for c in chunks]
        title = str(first.get("title") or first["doc_id"]).replace("\n", " ").strip()
        body = [f"# {title}", ""]
        for c in chunks:
            section = str(c.get("section_title") or c.get("anchor") or "Section").replace("\n", " ").strip()
            body += [f"## {section}", "", _section_content(c), ""]
        front = yaml.safe_dump(meta, allow_unicode=True, sort_keys=True)
        out.append(ProjectedDocument(key=key, markdown=f"---\n{front}---\n" + "\n".join(body)))
    return out
