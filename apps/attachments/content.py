"""What an uploaded file is, decided by its bytes: the attachment content checks.

A requester may attach photos (PNG, JPEG, GIF, WebP), text logs and PDF documents to a fault
report. The type is taken from the content, never from the name or the browser's declared type:
an image must decode as the format its first bytes announce (Pillow), a PDF must parse (pypdf), a
log must be text (UTF-8, UTF-16 with a byte-order mark, or GB 18030 as Chinese Windows tools
write). The name's extension and the declared type must then agree with what the content is: a
``.png`` holding a PDF, or a file declared ``image/jpeg`` holding text, *lies about its type* and is
refused, as is a name carrying a path. Every refusal is a :class:`Refused` with a message for the
person who sent the file.

Pure functions of bytes and strings; no database, no storage.
"""

from __future__ import annotations

import io
import re
import unicodedata
from dataclasses import dataclass

from django.utils.translation import gettext as _

#: the content types faultdesk accepts, by kind
IMAGE_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
PDF_TYPE = "application/pdf"
TEXT_TYPE = "text/plain"
ALLOWED_TYPES = frozenset({*IMAGE_TYPES.values(), PDF_TYPE, TEXT_TYPE})

#: the extensions a name may carry, and the content type each one promises
EXTENSION_TYPES = {
    ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".jfif": "image/jpeg",
    ".gif": "image/gif", ".webp": "image/webp", ".pdf": PDF_TYPE,
    ".txt": TEXT_TYPE, ".log": TEXT_TYPE, ".text": TEXT_TYPE, ".out": TEXT_TYPE, ".csv": TEXT_TYPE,
    ".json": TEXT_TYPE, ".xml": TEXT_TYPE, ".cfg": TEXT_TYPE, ".conf": TEXT_TYPE, ".ini": TEXT_TYPE,
}
#: declared (browser or client) types that say nothing about the content and so cannot lie
_GENERIC_DECLARED = frozenset({"", "application/octet-stream", "binary/octet-stream", "application/x-download"})
#: declared types that promise text (a log uploaded from a browser is declared as one of these)
_TEXT_DECLARED = frozenset({"text/plain", "text/x-log", "text/csv", "application/json", "text/json", "text/xml",
                            "application/xml", "text/x-ini"})

#: the longest name kept (characters)
MAX_NAME_CHARS = 200
#: the most characters of a log kept as its text for retrieval and the model (request data)
MAX_TEXT_CHARS = 1000
#: the largest decoded image, in pixels (a "decompression bomb" is refused, not decoded)
MAX_IMAGE_PIXELS = 50_000_000

_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:")


class Refused(ValueError):
    """A file faultdesk will not take; ``str(exc)`` says why, in the reader's language."""


@dataclass(frozen=True)
class Inspected:
    """A file that passed: its ``name`` (as sent, checked), ``content_type`` (from the content),
    ``kind`` (``image`` | ``pdf`` | ``text``) and, for a text file, ``text`` (at most
    :data:`MAX_TEXT_CHARS` characters: its lines that read like errors first, else its start)."""

    name: str
    content_type: str
    kind: str
    text: str = ""


def name_check(raw_name: str) -> str:
    """``raw_name`` as the client sent it, when it is a plain file name; raises :class:`Refused`
    when it is empty, carries a directory part (``/``, ``\\``, a drive letter, ``..``), starts with a
    dot, holds control characters, or is longer than :data:`MAX_NAME_CHARS`."""
    name = unicodedata.normalize("NFC", raw_name or "")
    if not name.strip():
        raise Refused(_("a file has no name"))
    if any(sep in name for sep in ("/", "\\")) or _WINDOWS_DRIVE.match(name) or name in (".", ".."):
        raise Refused(_("“%(name)s”: a file name may not contain a path; send the file under its own name")
                      % {"name": name[:MAX_NAME_CHARS]})
    if any(unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in name):
        raise Refused(_("“%(name)s”: the file name holds control characters")
                      % {"name": "".join(ch for ch in name if ch.isprintable())[:MAX_NAME_CHARS]})
    if name.startswith("."):
        raise Refused(_("“%(name)s”: a file name may not start with a dot") % {"name": name[:MAX_NAME_CHARS]})
    if len(name) > MAX_NAME_CHARS:
        raise Refused(_("“%(name)s…”: the file name is longer than %(limit)s characters")
                      % {"name": name[:40], "limit": MAX_NAME_CHARS})
    return name


def inspect(name: str, data: bytes, declared_type: str | None = None) -> Inspected:
    """What the file ``name`` with content ``data`` is, checked (see the module docstring).
    ``declared_type`` is the content type the client declared (may be None). Raises
    :class:`Refused` for a bad name, an empty file, content that is none of the accepted kinds,
    a damaged image or PDF, or a name or declared type that disagrees with the content."""
    name = name_check(name)
    if not data:
        raise Refused(_("“%(name)s” is empty") % {"name": name})
    content_type, kind, text = _sniff(name, data)
    ext = _extension(name)
    if ext and ext not in EXTENSION_TYPES:
        raise Refused(_("“%(name)s”: files of type %(ext)s are not accepted; attach photos (PNG, JPEG, GIF, "
                        "WebP), text logs or PDF documents") % {"name": name, "ext": ext})
    if ext and EXTENSION_TYPES[ext] != content_type:
        raise Refused(_("“%(name)s” is named as %(promised)s but its content is %(actual)s; the file lies "
                        "about its type") % {"name": name, "promised": EXTENSION_TYPES[ext], "actual": content_type})
    declared = (declared_type or "").split(";")[0].strip().lower()
    if declared not in _GENERIC_DECLARED and not _declared_agrees(declared, content_type):
        raise Refused(_("“%(name)s” was sent as %(declared)s but its content is %(actual)s; the file lies "
                        "about its type") % {"name": name, "declared": declared[:100], "actual": content_type})
    return Inspected(name=name, content_type=content_type, kind=kind, text=text)


def _extension(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot > 0 else ""


def _declared_agrees(declared: str, actual: str) -> bool:
    if actual == TEXT_TYPE:
        return declared in _TEXT_DECLARED
    if actual == "image/jpeg":
        return declared in ("image/jpeg", "image/jpg", "image/pjpeg")
    if actual == PDF_TYPE:
        return declared in (PDF_TYPE, "application/x-pdf")
    return declared == actual


def _sniff(name: str, data: bytes) -> tuple[str, str, str]:
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n") or head.startswith(b"\xff\xd8\xff") \
            or head[:6] in (b"GIF87a", b"GIF89a") or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return _image(name, data), "image", ""
    if data.lstrip(b"\xef\xbb\xbf\r\n\t ")[:5] == b"%PDF-":
        _pdf(name, data)
        return PDF_TYPE, "pdf", ""
    text = _text(data)
    if text is None:
        raise Refused(_("“%(name)s”: its content is not a photo (PNG, JPEG, GIF, WebP), a text log or a PDF "
                        "document") % {"name": name})
    return TEXT_TYPE, "text", log_excerpt(text)


def _image(name: str, data: bytes) -> str:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise Refused(_("“%(name)s”: the picture is %(w)s × %(h)s pixels, larger than faultdesk takes")
                              % {"name": name, "w": img.width, "h": img.height})
            img.verify()  # PNG: checks every chunk's checksum
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # every format: decodes every pixel, so a truncated or damaged picture fails here
    except Refused:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise Refused(_("“%(name)s”: the picture cannot be read (%(error)s)")
                      % {"name": name, "error": str(exc)[:120]}) from None
    if fmt not in IMAGE_TYPES:
        raise Refused(_("“%(name)s”: pictures in %(format)s format are not accepted; send PNG, JPEG, GIF or WebP")
                      % {"name": name, "format": fmt})
    return IMAGE_TYPES[fmt]


def _pdf(name: str, data: bytes) -> None:
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        pages = len(reader.pages)
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as exc:
        raise Refused(_("“%(name)s”: the PDF document cannot be read (%(error)s)")
                      % {"name": name, "error": str(exc)[:120]}) from None
    if pages < 1:
        raise Refused(_("“%(name)s”: the PDF document has no pages") % {"name": name})


def _text(data: bytes) -> str | None:
    """The text of ``data`` when it is text (else None): UTF-8 (a BOM allowed), UTF-16 with a
    BOM, or GB 18030; with almost no control characters other than tab, newlines and escape."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encodings = ("utf-16",)
    elif b"\x00" in data:
        return None  # binary, or UTF-16 without a byte-order mark (which no log tool here writes)
    else:
        encodings = ("utf-8-sig", "gb18030")
    for encoding in encodings:
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError:
            continue
        controls = sum(1 for ch in text if unicodedata.category(ch) == "Cc" and ch not in "\t\n\r\x1b\x0c")
        if controls <= max(1, len(text) // 1000):
            return text
    return None


#: a line that reads like a fault: what a technician looks for first in a log
_SIGNAL = re.compile(
    r"error|fail|fault|fatal|critical|alarm|alert|warn|exception|denied|timeout|timed out|panic|abort|"
    r"\b[A-Z]{1,4}-?\d{2,5}\b|0x[0-9a-fA-F]{4,}|错误|故障|失败|异常|告警|报警|警告|超时|卡纸",
    re.IGNORECASE,
)


def log_excerpt(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """At most ``limit`` characters of a log: its lines that read like faults (error, failure,
    alarm, codes like ``E-203`` or ``0x8007``; in English and Chinese), each once and in order;
    the log's first lines when none does. Control characters are dropped."""
    lines, seen = [], set()
    clean = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) != "Cc")
    for line in clean.splitlines():
        line = line.strip()[:200]
        if line and _SIGNAL.search(line) and line not in seen:
            seen.add(line)
            lines.append(line)
    if not lines:
        lines = [line.strip()[:200] for line in clean.splitlines() if line.strip()]
    out, size = [], 0
    for line in lines:
        if size + len(line) + 1 > limit:
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)
