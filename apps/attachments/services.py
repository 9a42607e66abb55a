"""Attachments of a fault report: check them all, store their bytes, record them with the task.

:func:`attachments_check` runs before anything is written: every file is read (at most
``ATTACHMENT_MAX_BYTES``), checked by its content (:mod:`apps.attachments.content`) and digested;
every problem of every file is reported at once, so the requester fixes them in one go, and nothing
of the report is kept half-filed. :func:`attachments_store` puts the checked bytes into the
``attachments`` storage (before the task's transaction: a file stored for a report that then fails
is stored under its digest and found again, never half-written), and :func:`attachments_record`
writes their rows in the task's own transaction.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from django.core.files.base import ContentFile
from django.core.files.storage import storages
from django.db import connection
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from apps.attachments import content
from apps.attachments.limits import limits
from apps.attachments.models import Attachment
from apps.core.errors import Unprocessable

#: the ``STORAGES`` alias attachments are kept in
STORAGE_ALIAS = "attachments"


@dataclass(frozen=True)
class CheckedFile:
    """A file that passed every check: what :class:`~apps.attachments.content.Inspected` says of it,
    its ``size`` (bytes), ``sha256`` (hex) and ``data`` (its bytes)."""

    name: str
    content_type: str
    kind: str
    size: int
    sha256: str
    text: str
    data: bytes

    def metadata(self) -> dict:
        """``{"name", "content_type", "size", "sha256"}`` (and ``"text"`` for a log): what the
        ``task.accepted`` event records of it."""
        out = {"name": self.name, "content_type": self.content_type, "size": self.size, "sha256": self.sha256}
        if self.text:
            out["text"] = self.text
        return out


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.1f}".rstrip("0").rstrip(".")


def attachments_check(files: Iterable[tuple[str, object, str | None]],
                      skipped: Iterable[tuple[str, int]] = ()) -> list[CheckedFile]:
    """Check the files of one report. ``files``: ``[(name as sent, file-like or bytes, declared
    content type or None)]``; ``skipped``: ``[(name as sent, bytes read)]`` of files the upload
    stopped reading for their size. Returns the checked files in order.

    Raises :class:`~apps.core.errors.Unprocessable` listing every problem (``extra["attachments"]``:
    one message per refused file): more than ``ATTACHMENTS_MAX_FILES`` files, a file over
    ``ATTACHMENT_MAX_BYTES``, all of them over ``ATTACHMENTS_MAX_TOTAL_BYTES``, two identical files,
    and each refusal of :func:`apps.attachments.content.inspect` (path in the name, content that is
    not a picture, a log or a PDF, a name or declared type that lies about the content)."""
    cap = limits()
    files, skipped = list(files), list(skipped)
    problems: list[str] = []
    count = len(files) + len(skipped)
    if count > cap["files"]:
        problems.append(ngettext("%(count)s files were attached; a report takes at most %(limit)s file",
                                 "%(count)s files were attached; a report takes at most %(limit)s files",
                                 cap["files"]) % {"count": count, "limit": cap["files"]})
    for raw, size in skipped:
        problems.append(_("“%(name)s” is over %(limit)s MB (at least %(size)s MB)")
                        % {"name": raw[:content.MAX_NAME_CHARS], "limit": _megabytes(cap["file_bytes"]),
                           "size": _megabytes(size)})
    checked, seen, total = [], {}, 0
    for raw, f, declared in files:
        data = _read(f, cap["file_bytes"])
        if data is None:
            problems.append(_("“%(name)s” is over %(limit)s MB")
                            % {"name": raw[:content.MAX_NAME_CHARS], "limit": _megabytes(cap["file_bytes"])})
            continue
        try:
            found = content.inspect(raw, data, declared)
        except content.Refused as exc:
            problems.append(str(exc))
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            problems.append(_("“%(name)s” is the same file as “%(other)s”; attach it once")
                            % {"name": found.name, "other": seen[digest]})
            continue
        seen[digest] = found.name
        total += len(data)
        checked.append(CheckedFile(name=found.name, content_type=found.content_type, kind=found.kind,
                                   size=len(data), sha256=digest, text=found.text, data=data))
    if total > cap["total_bytes"]:
        problems.append(_("the files come to %(size)s MB; a report takes at most %(limit)s MB of files")
                        % {"size": _megabytes(total), "limit": _megabytes(cap["total_bytes"])})
    if problems:
        raise Unprocessable(" ".join(problems) if len(problems) == 1 else
                            _("The attachments were not accepted: %(problems)s") % {"problems": " ".join(problems)},
                            attachments=problems)
    return checked


def _read(f, cap: int) -> bytes | None:
    """The bytes of ``f`` (bytes, or a file-like object read from its start), or None when it holds
    more than ``cap`` bytes (never reading more than ``cap + 1``)."""
    if isinstance(f, bytes | bytearray):
        return bytes(f) if len(f) <= cap else None
    if getattr(f, "size", None) is not None and f.size > cap:
        return None
    if hasattr(f, "seek"):
        f.seek(0)
    data = f.read(cap + 1)
    return data if len(data) <= cap else None


def storage_key(tenant_id: int, sha256: str) -> str:
    """Where a tenant's file with digest ``sha256`` lives in the attachments storage: one file per
    tenant and content, so a tenant never reads another's bytes through a shared digest."""
    return f"tenant-{int(tenant_id)}/{sha256[:2]}/{sha256}"


def attachments_store(*, tenant_id: int, files: list[CheckedFile]) -> list[str]:
    """Put each checked file's bytes into the ``attachments`` storage under
    :func:`storage_key` (a file already there is kept when it still hashes to its digest, and
    replaced when it does not).
    Returns the keys in order. Raises what the storage raises (``OSError`` for a full disk)."""
    storage = storages[STORAGE_ALIAS]
    keys = []
    for f in files:
        key = storage_key(tenant_id, f.sha256)
        if storage.exists(key) and not _holds(storage, key, f.sha256):
            storage.delete(key)  # damaged or altered at rest: these are the bytes the digest names
        if not storage.exists(key):
            saved = storage.save(key, ContentFile(f.data))
            if saved != key:  # a concurrent save of the same bytes won the name: keep one copy
                storage.delete(saved)
        keys.append(key)
    return keys


def _holds(storage, key: str, sha256: str) -> bool:
    """Whether the stored file ``key`` still hashes to ``sha256``; False when it is gone (the
    retention purge may delete it between a look and this read: the caller stores it again)."""
    digest = hashlib.sha256()
    try:
        with storage.open(key, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except FileNotFoundError:
        return False
    return digest.hexdigest() == sha256


def storage_key_lock(key: str) -> None:
    """Hold a transaction-level advisory lock on the stored file ``key`` until the caller's
    transaction ends (call inside one). The retention purge holds it while it decides to delete a
    file no row needs any more; :func:`attachments_record` while it makes sure its files are there."""
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"faultdesk.attachment:{key}"])


def attachments_record(*, tenant_id: int, task_id: uuid.UUID, files: list[CheckedFile], keys: list[str]) -> None:
    """Write the rows of ``task_id``'s attachments (in the caller's transaction: the task's own).

    Each file's key is locked (:func:`storage_key_lock`, in key order) and its bytes stored again
    when they are gone: the retention purge may have deleted the same content, held by a purged
    task, between :func:`attachments_store` and this transaction. Raises what the storage raises."""
    storage = storages[STORAGE_ALIAS]
    for key in sorted(set(keys)):
        storage_key_lock(key)
    for f, key in zip(files, keys, strict=True):
        if not storage.exists(key):
            saved = storage.save(key, ContentFile(f.data))
            if saved != key:  # stored meanwhile under the name: keep one copy
                storage.delete(saved)
    Attachment.objects.bulk_create([
        Attachment(tenant_id=tenant_id, task_id=task_id, position=i, name=f.name, content_type=f.content_type,
                   kind=f.kind, size=f.size, sha256=f.sha256, storage_key=key, text=f.text)
        for i, (f, key) in enumerate(zip(files, keys, strict=True))
    ])
