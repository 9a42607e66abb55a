"""The evidence view: one cited chunk version, shown only if the viewer may
read it *now* (the permission is re-checked on every view, not taken from when it was cited), with
a notice when the cited version has been superseded or its document retired."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.views.decorators.http import require_GET

from apps.accounts.pages import page_principal
from apps.core.pages import render_fragment
from apps.evidence.models import Chunk
from apps.evidence.selectors import chunk_readable


@login_required
@require_GET
def evidence_detail(request, chunk_id: int):
    """404 for a chunk of another tenant or a scope the viewer cannot read now."""
    p = page_principal(request)
    chunk = chunk_readable(chunk_id=chunk_id, tenant_id=p.tenant_id, scopes=p.scopes)
    if chunk is None:
        raise Http404("no such evidence, or you may not read it")
    version = chunk.document_version
    document = version.document
    current = None
    if not chunk.is_current and not document.retired:
        current = (Chunk.objects.for_tenant(p.tenant_id)
                   .filter(document_version__document=document, is_current=True, section=chunk.section,
                           scope__in=list(p.scopes)).first())
    from django.utils import timezone

    from apps.evidence.governance import evidence_standing

    return render_fragment(request, "evidence/detail.html", {
        "chunk": chunk, "version": version, "document": document, "current": current,
        "standing": evidence_standing(version.metadata or {}, now=timezone.now()),
        "superseded": not chunk.is_current and not document.retired,
    })
