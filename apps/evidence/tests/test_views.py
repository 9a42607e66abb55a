"""The evidence view: answers link their citations to it; it re-checks the viewer's permission on
every view and says when the cited version was superseded."""

from __future__ import annotations

from django.urls import reverse

from apps.accounts.models import AccessScope, Membership
from apps.evidence.models import Chunk
from apps.evidence.services import document_ingest
from apps.tasks.services import task_submit
from tests.conftest import KB, drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def test_citations_link_to_evidence_that_is_rechecked_and_marked_superseded(client, tenant, requester, device, kb):
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task.pk)
    client.force_login(requester)
    page = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    cited = task.state["evidence"][0]
    url = reverse("evidence-detail", args=[cited["chunk_id"]])
    assert f'href="{url}"' in page
    view = client.get(url).content.decode()
    assert cited["document_title"] in view and f"version {cited['version']}" in view and "Superseded" not in view

    # The document changes: the cited version is kept, and says it was superseded.
    chunk = Chunk.objects.get(pk=cited["chunk_id"])
    doc = chunk.document_version.document
    raw = (KB / doc.source).read_text() + "\n\n## Addendum\n\nA newer note about this procedure.\n"
    document_ingest(tenant=tenant, source=doc.source, raw=raw, scope=doc.scope)
    view = client.get(url).content.decode()
    assert "Superseded" in view and f"the current version is {cited['version'] + 1}" in view

    # Permission is checked when the evidence is read, not when it was cited.
    Membership.objects.filter(user=requester).update(scopes=[s for s in AccessScope.values if s != chunk.scope])
    assert client.get(url).status_code == 404
