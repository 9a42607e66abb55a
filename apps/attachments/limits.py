"""How many attachments a report may carry, and how large (``FAULTDESK`` settings)."""

from __future__ import annotations

from django.conf import settings


def limits() -> dict:
    """``{"files", "file_bytes", "total_bytes"}``: the most files one report may carry, the largest
    file and the most bytes of all its files (``FAULTDESK`` settings ``ATTACHMENTS_MAX_FILES``,
    ``ATTACHMENT_MAX_BYTES``, ``ATTACHMENTS_MAX_TOTAL_BYTES``)."""
    conf = settings.FAULTDESK
    return {"files": conf["ATTACHMENTS_MAX_FILES"], "file_bytes": conf["ATTACHMENT_MAX_BYTES"],
            "total_bytes": conf["ATTACHMENTS_MAX_TOTAL_BYTES"]}
