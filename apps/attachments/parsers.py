"""DRF's multipart parser over :class:`apps.attachments.uploads.RecordingParser` (API request
bodies; kept apart from the services, which never import the API framework)."""

from __future__ import annotations

from django.conf import settings
from django.http.multipartparser import MultiPartParserError
from django.utils.translation import gettext as _
from rest_framework.exceptions import ParseError
from rest_framework.parsers import DataAndFiles
from rest_framework.parsers import MultiPartParser as DrfMultiPartParser

from apps.attachments.uploads import RecordingParser


class AttachmentMultiPartParser(DrfMultiPartParser):
    """DRF's multipart parser over the recording parser, so the API sees the names as sent."""

    def parse(self, stream, media_type=None, parser_context=None):
        parser_context = parser_context or {}
        request = parser_context["request"]
        meta = request.META.copy()
        meta["CONTENT_TYPE"] = media_type
        try:
            data, files = RecordingParser(meta, stream, request.upload_handlers,
                                           parser_context.get("encoding", settings.DEFAULT_CHARSET)).parse()
        except MultiPartParserError as exc:
            raise ParseError(_("Multipart form parse error - %(error)s") % {"error": exc}) from None
        return DataAndFiles(data, files)
