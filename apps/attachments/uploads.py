"""Reading attached files off a request without losing what the requester typed.

Django's multipart parser silently cuts a file name down to its last path part and keeps every
byte of every file. For attachments both would be wrong: a name that carries a path
(``../../etc/passwd.log``) must be *refused*, not quietly renamed, and a file over the size limit
must not be read into memory or onto disk at all. :class:`UploadRecorder` is the first upload
handler of every multipart request (installed by :class:`UploadLimitsMiddleware`): it records each
file's name exactly as sent and skips (``SkipFile``) the bytes of one past the limit, while the
request's other fields are parsed as usual — the form or the API then refuses the file with a
clear message and keeps the rest of the report. :class:`apps.attachments.parsers.AttachmentMultiPartParser`
gives DRF the same parser.
"""

from __future__ import annotations

import html

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, SkipFile
from django.http import HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParser
from django.utils.translation import gettext as _

from apps.attachments.limits import limits


class UploadRecorder(FileUploadHandler):
    """First upload handler of a multipart request: records, in order, each file's field, its name
    as sent and whether it was skipped for its size (``files``), and stops reading a file's bytes once it
    passes ``ATTACHMENT_MAX_BYTES``."""

    def __init__(self, request=None):
        super().__init__(request)
        #: one entry per file, in the order sent: ``{"field", "raw", "skipped_at"}`` (bytes read
        #: when it was skipped for its size, else None)
        self.files: list[dict] = []
        self.pending_raw: str | None = None
        self.cap = limits()["file_bytes"]

    def new_file(self, field_name, file_name, *args, **kwargs):
        super().new_file(field_name, file_name, *args, **kwargs)
        raw = self.pending_raw if self.pending_raw is not None else file_name
        self.pending_raw = None
        self.files.append({"field": field_name, "raw": raw, "skipped_at": None})

    def receive_data_chunk(self, raw_data, start):
        if start + len(raw_data) > self.cap:
            self.files[-1]["skipped_at"] = start + len(raw_data)
            raise SkipFile()
        return raw_data

    def file_complete(self, file_size):
        return None  # the next handler (memory or temporary file) makes the file


class RecordingParser(MultiPartParser):
    """Django's multipart parser, telling the request's :class:`UploadRecorder` each file name as
    the client sent it (before Django's own clean-up of the name)."""

    def sanitize_file_name(self, file_name):
        recorder = next((h for h in self._upload_handlers if isinstance(h, UploadRecorder)), None)
        if recorder is not None:
            recorder.pending_raw = html.unescape(file_name)
        cleaned = super().sanitize_file_name(file_name)
        if not cleaned and file_name and recorder is not None:
            # ".." or a name of only a path: Django would drop the file without a word
            cleaned = "unnamed"
        return cleaned


def recorded_uploads(request, field: str) -> tuple[list[tuple[str, object]], list[tuple[str, int]]]:
    """The files of ``field`` in ``request`` as ``[(name as sent, UploadedFile)]`` in the order
    sent, and the ones skipped for their size as ``[(name as sent, bytes read when skipped)]``. Works for a
    Django request and a DRF one (the recorder sits on the Django request)."""
    django_request = getattr(request, "_request", request)
    recorder = getattr(django_request, "upload_recorder", None)
    files = request.FILES.getlist(field) if hasattr(request.FILES, "getlist") else []
    if recorder is None:
        return [(f.name, f) for f in files], []
    entries = [e for e in recorder.files if e["field"] == field]
    kept = [e["raw"] for e in entries if e["skipped_at"] is None]
    skipped = [(e["raw"], e["skipped_at"]) for e in entries if e["skipped_at"] is not None]
    # Django adds a completed file to FILES in the order it was read: the kept entries, one each.
    return [(kept[i] if i < len(kept) else f.name, f) for i, f in enumerate(files)], skipped


def _parse_recording(request):
    def parse_file_upload(META, post_data):
        parser = RecordingParser(META, post_data, request.upload_handlers, request.encoding)
        return parser.parse()
    return parse_file_upload


class UploadLimitsMiddleware:
    """For every multipart request: refuse (413) a body larger than all attachments and fields may
    be, before reading it; otherwise install :class:`UploadRecorder` as the first upload handler and
    the recording parser, before any other middleware reads the form."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.method == "POST" and request.content_type == "multipart/form-data":
            length = request.META.get("CONTENT_LENGTH") or "0"
            cap = limits()["total_bytes"] + (settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0) + 64 * 1024
            if length.isdigit() and int(length) > cap:
                detail = _("the request is over %(limit)s MB: attach at most %(total)s MB of files") % {
                    "limit": round(cap / 2**20), "total": round(limits()["total_bytes"] / 2**20)}
                if request.path.startswith("/api/"):
                    return JsonResponse({"error": "too_large", "detail": detail}, status=413)
                return HttpResponse(detail, status=413, content_type="text/plain; charset=utf-8")
            recorder = UploadRecorder(request)
            request.upload_handlers.insert(0, recorder)
            request.upload_recorder = recorder
            request.parse_file_upload = _parse_recording(request)
        return self.get_response(request)


__all__ = ["RecordingParser", "UploadLimitsMiddleware", "UploadRecorder", "recorded_uploads"]
