"""Structure-aware chunking of Markdown, HTML and plain text (DESIGN.md §9).

A chunk keeps its location: the section heading path it lies under and its character offsets in
the normalised document text, so that a citation can say "document, version, section".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from html.parser import HTMLParser

MAX_CHUNK_CHARS = 1200

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk before embedding: ``section`` is the heading path ("Title › Section")."""

    ordinal: int
    section: str
    start: int
    end: int
    text: str


@dataclass(frozen=True)
class ParsedDocument:
    """A parsed file: ``text`` is what offsets refer to (front matter removed); ``metadata`` is
    the governance metadata as written in the file (unnormalised; see
    :func:`apps.evidence.governance.metadata_normalise`)."""

    title: str
    text: str
    chunks: list[ChunkSpec]
    metadata: dict = field(default_factory=dict)


def _split_long(start: int, body: str) -> list[tuple[int, str]]:
    """Split ``body`` (starting at absolute offset ``start``) at paragraph breaks so that no piece
    exceeds :data:`MAX_CHUNK_CHARS` (a single longer paragraph stays whole)."""
    pieces: list[tuple[int, str]] = []
    cur_start, cur = start, ""
    pos = start
    for para in re.split(r"(\n\s*\n)", body):
        if cur and len(cur) + len(para) > MAX_CHUNK_CHARS and para.strip():
            pieces.append((cur_start, cur))
            cur_start, cur = pos, ""
        cur += para
        pos += len(para)
    if cur.strip():
        pieces.append((cur_start, cur))
    return pieces


def chunk_markdown(text: str, *, fallback_title: str) -> ParsedDocument:
    """Chunk Markdown along its headings. The first H1 is the title; each ``##``/``###`` section
    (with its heading line) becomes one chunk, split further at paragraphs when long."""
    text = text.replace("\r\n", "\n")
    headings = list(_HEADING.finditer(text))
    title = fallback_title
    for m in headings:
        if len(m.group(1)) == 1:
            title = m.group(2).strip()[:300]
            break
    bounds = [m.start() for m in headings if len(m.group(1)) >= 2]
    starts = [0, *bounds]
    ends = [*bounds, len(text)]
    specs: list[ChunkSpec] = []
    for s, e in zip(starts, ends, strict=True):
        body = text[s:e]
        if not _HEADING.sub("", body).strip():
            continue  # nothing but headings (a title alone before the first section)
        m = _HEADING.match(text, s)
        section = m.group(2).strip() if m and len(m.group(1)) >= 2 else "Summary"
        for piece_start, piece in _split_long(s, body):
            stripped = piece.strip()
            if not stripped:
                continue
            lead = len(piece) - len(piece.lstrip())
            specs.append(
                ChunkSpec(
                    ordinal=len(specs),
                    section=section,
                    start=piece_start + lead,
                    end=piece_start + lead + len(stripped),
                    text=stripped,
                )
            )
    return ParsedDocument(title=title, text=text, chunks=specs)


class _HTMLToMarkdown(HTMLParser):
    """Minimal HTML → Markdown-ish text: headings become ``#`` lines, block tags break lines,
    script/style are dropped."""

    _BLOCK = {"p", "div", "li", "tr", "br", "section", "article", "pre", "table", "ul", "ol"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif re.fullmatch(r"h[1-6]", tag):
            self.out.append("\n\n" + "#" * int(tag[1]) + " ")
        elif tag in self._BLOCK:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif re.fullmatch(r"h[1-6]", tag):
            self.out.append("\n\n")
        elif tag in self._BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if not self._skip:
            self.out.append(data)


def html_to_markdown(html: str) -> str:
    parser = _HTMLToMarkdown()
    parser.feed(html)
    text = "".join(parser.out)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def excerpt_body(text: str) -> str:
    """A chunk's text without its leading Markdown heading line (a citation names the section)."""
    first, _, rest = text.partition("\n")
    return rest.strip() if first.startswith("#") and rest.strip() else text


def first_statement(text: str, *, limit: int = 200) -> str:
    """The first sentence or list item of ``text`` (heading and list markers removed), at most
    ``limit`` characters — a one-line summary of a chunk."""
    for line in excerpt_body(text).splitlines():
        line = re.sub(r"^\s*(?:[-*+]|\d+[.)])\s+", "", line).strip()
        if len(line) > 20:
            sentence = re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0]
            return sentence[:limit]
    return " ".join(excerpt_body(text).split())[:limit]


class UnreadableDocument(ValueError):
    """A file that cannot be read as its kind (a damaged or encrypted PDF, say)."""


def pdf_to_markdown(data: bytes, *, fallback_title: str) -> str:
    """The text of a PDF (with the maintained ``pypdf`` library) as Markdown: the document title
    (its metadata title, else ``fallback_title``) as ``#``, then one ``## Page N`` section per page
    that has text, so chunks keep their page as their location. Raises :class:`UnreadableDocument`."""
    import io

    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise UnreadableDocument("the PDF is encrypted")
        meta_title = reader.metadata.title if reader.metadata else None
        title = " ".join(str(meta_title).split()) if isinstance(meta_title, str) and meta_title.strip() \
            else fallback_title  # one line: a title cannot open a section of its own
        pages = [(i, (page.extract_text() or "").strip()) for i, page in enumerate(reader.pages, start=1)]
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        if isinstance(exc, UnreadableDocument):
            raise
        raise UnreadableDocument(f"not a readable PDF: {exc}") from exc
    body = "\n\n".join(f"## Page {i}\n\n{text}" for i, text in pages if text)
    if not body:
        raise UnreadableDocument("the PDF has no extractable text (scanned images need OCR first)")
    return _pdf_front_matter(reader.metadata) + f"# {title}\n\n{body}\n"


def _pdf_front_matter(info) -> str:
    """The PDF's document-information entries named after governance fields (``/doc_id``,
    ``/governance_status``...) as a YAML front matter block ("" when it has none)."""
    import yaml

    from apps.evidence.governance import FIELDS

    found = {}
    for key, value in (info or {}).items():
        name = str(key).lstrip("/").lower()
        if name in FIELDS and isinstance(value, str) and value.strip():
            found[name] = value.strip()
    if not found:
        return ""
    return "---\n" + yaml.safe_dump(found, allow_unicode=True, sort_keys=True) + "---\n"


def read_source(name: str, data: bytes) -> str:
    """A file's content as the text faultdesk stores and chunks: UTF-8 text as is, a PDF's text
    as Markdown by page (:func:`pdf_to_markdown`). Raises :class:`UnreadableDocument`."""
    if name.lower().endswith(".pdf"):
        text = pdf_to_markdown(data, fallback_title=_stem(name))
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UnreadableDocument(f"not UTF-8 text: {exc}") from exc
    return text.replace("\x00", "")  # PostgreSQL text cannot hold NUL; it carries no meaning here


def _stem(name: str) -> str:
    return re.sub(r"[-_]+", " ", name.rsplit("/", 1)[-1].rsplit(".", 1)[0]).strip().capitalize()


def parse_document(name: str, raw: str) -> ParsedDocument:
    """Parse a file's text by its extension (``.md``, ``.html``/``.htm``, ``.txt``; ``.pdf`` after
    :func:`read_source`, as Markdown with a section per page), with its governance metadata: a
    YAML front matter block in Markdown, text and PDF (:func:`read_source` writes a PDF's
    information entries as one), ``<meta name="faultdesk:...">`` tags in HTML. Raises
    :class:`~apps.evidence.governance.MetadataInvalid` for front matter that cannot be read."""
    from apps.evidence.governance import front_matter_split, html_metadata

    stem = _stem(name)
    lower = name.lower()
    if lower.endswith((".html", ".htm")):
        return replace(chunk_markdown(html_to_markdown(raw), fallback_title=stem), metadata=html_metadata(raw))
    metadata, raw = front_matter_split(raw)
    if lower.endswith((".md", ".pdf")):
        return replace(chunk_markdown(raw, fallback_title=stem), metadata=metadata)
    # Plain text: paragraphs only, the first line is the title.
    text = raw.replace("\r\n", "\n")
    first = text.strip().split("\n", 1)[0].strip() or stem
    specs = [
        ChunkSpec(ordinal=i, section="Text", start=s, end=s + len(p.strip()), text=p.strip())
        for i, (s, p) in enumerate(_split_long(0, text))
    ]
    return ParsedDocument(title=first[:300], text=text, chunks=specs, metadata=metadata)
