"""The approver is told, before deciding, when evidence a pending approval cites moved while it
waited — superseded, withdrawn, or no longer readable by the requester — and what approving will
then do, as the task's resume decides it (long-task-runtime.md, resume): ask again (the action
cannot come out the same), re-validate (sent only if it comes out the same), or, on a task without
plan versions, send the action as it was asked. The queue card and the approvals API say the same,
in English and Chinese; every claim is checked against what the task then does."""

from __future__ import annotations

import re

import pytest

from apps.accounts.models import Membership
from apps.approvals.models import ApprovalRequest
from apps.approvals.selectors import ASKS_AGAIN, REVALIDATES, SENT_AS_ASKED, evidence_moved
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.evidence.services import document_ingest, document_retire
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import KB, drive, p

pytestmark = [pytest.mark.django_db(transaction=True)]

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
QUEUE = "/approvals/"
ZH = {"HTTP_ACCEPT_LANGUAGE": "zh-hans"}


@pytest.fixture
def plans(monkeypatch):
    monkeypatch.setattr(reducer, "CURRENT", reducer.v6.VERSION)


def _supersede(tenant, source: str) -> None:
    scope, name = source.split("/", 1)
    document_ingest(tenant=tenant, source=source, scope=scope, raw=(KB / scope / name).read_text()
                    + "\n\n## Note\n\nSwitch the printer off before opening the fuser door.\n")


def _waiting(requester, device) -> tuple[Task, ApprovalRequest]:
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    return task, ApprovalRequest.objects.get(task=task, status="PENDING")


def _sources(approval) -> list[str]:
    """The documents the approval's action names, in citation order."""
    named = {str(c) for c in approval.params["evidence"]}
    return list(dict.fromkeys(r["source"] for r in approval.evidence if str(r["chunk_id"]) in named))


def _banner(html: str) -> tuple[str, str] | None:
    """``(if_approved, text)`` of the card's evidence-moved notice, or None."""
    m = re.search(r'<p class="msg error evidence-moved" data-if-approved="([a-z_]+)">(.*?)</p>', html, re.S)
    return (m.group(1), re.sub(r"\s+", " ", m.group(2))) if m else None


def _api(client, approval) -> tuple[dict, str | None]:
    body = client.get(f"/api/approvals/{approval.pk}/").json()
    return body["evidence_moved"], body["if_approved"]


def _chunks_of(approval, sources) -> set[str]:
    return {str(r["chunk_id"]) for r in approval.evidence if r["source"] in sources}


def test_cited_evidence_superseded_or_withdrawn_is_marked_and_approving_asks_again(
        plans, requester, approver, device, kb, tenant, client):
    """The action names the moved chunks, so the re-draft cannot come out the same: the card says
    approving will not send it and asks again — and it does."""
    task, first = _waiting(requester, device)
    client.force_login(approver)
    assert _banner(client.get(QUEUE).content.decode()) is None, "nothing moved yet"
    assert _api(client, first) == ({}, None)
    sources = _sources(first)
    assert len(sources) > 1, sources
    _supersede(tenant, sources[0])
    document_retire(tenant=tenant, source=sources[1])
    html = client.get(QUEUE).content.decode()
    kind, text = _banner(html)
    title = next(r["document_title"] for r in first.evidence if r["source"] == sources[0])
    assert kind == ASKS_AGAIN and f"has changed since it was asked: {title} v" in text
    assert "will not be sent as it is" in text
    assert "superseded since it was asked" in html and "withdrawn since it was asked" in html
    expected = {**dict.fromkeys(_chunks_of(first, sources[:1]), "superseded"),
                **dict.fromkeys(_chunks_of(first, sources[1:2]), "retired")}
    assert _api(client, first) == (expected, ASKS_AGAIN)
    [listed] = client.get("/api/approvals/", {"status": "PENDING"}).json()
    assert (listed["evidence_moved"], listed["if_approved"]) == (expected, ASKS_AGAIN)
    zh = client.get(QUEUE, **ZH).content.decode()
    kind, text = _banner(zh)
    assert "此操作不会按原样发送" in text and f"《{title}》v" in text
    assert "请求审批后已被新版本取代" in zh and "请求审批后已撤回" in zh and "since it was asked" not in zh
    # what the card said happens: nothing is sent, the approver is asked again
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == "INVALIDATED" and task.status == reducer.WAITING_APPROVAL
    assert not TaskEvent.objects.filter(task=task, type="intent.committed").exists()
    second = ApprovalRequest.objects.get(task=task, status="PENDING")
    assert _api(client, second) == ({}, None) and _api(client, first) == ({}, None)


def test_moved_evidence_the_action_does_not_name_is_revalidated(plans, requester, approver, device, kb, tenant):
    """Evidence the approval carries but its action does not name can move without changing the
    action: approving re-drafts first and sends only if it comes out the same (the local drafter
    names every chunk it retrieved, so the approval is narrowed here, in memory)."""
    task, first = _waiting(requester, device)
    sources = _sources(first)
    kept = [c for c in first.params["evidence"] if str(c) not in _chunks_of(first, sources[:1])]
    first.params = {**first.params, "evidence": kept}
    _supersede(tenant, sources[0])
    moved = evidence_moved(principal=p(approver), approvals=[first])[first.pk]
    assert moved.if_approved == REVALIDATES
    assert set(moved.chunks) == _chunks_of(first, sources[:1]) and set(moved.chunks.values()) == {"superseded"}


def test_a_requester_who_lost_the_scope_of_a_cited_document_makes_approving_ask_again(
        plans, requester, approver, device, kb, tenant, client):
    """The resume re-checks that the requester may still read every cited chunk: the queue reads
    them with the requester's scopes now, not the approver's, and says approving asks again."""
    task, first = _waiting(requester, device)
    tier2 = _chunks_of(first, {r["source"] for r in first.evidence if r["source"].startswith("tier2/")})
    assert tier2, "the approval cites a tier2 procedure"
    Membership.objects.filter(user=requester, tenant=tenant).update(scopes=["public"])
    client.force_login(approver)
    html = client.get(QUEUE).content.decode()
    assert _banner(html)[0] == ASKS_AGAIN and "no longer readable by the requester" in html
    assert _api(client, first) == (dict.fromkeys(tier2, "unreadable"), ASKS_AGAIN)
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    first.refresh_from_db()
    assert first.status == "INVALIDATED" and "no longer readable" in first.closed_reason
    assert not TaskEvent.objects.filter(task=task, type="intent.committed").exists()


def test_a_task_without_plan_versions_is_told_the_action_goes_as_asked(
        monkeypatch, requester, approver, device, kb, tenant, client, refservice):
    """A task filed under a reducer without plan versions (reducer/5) does not re-check evidence
    versions on resume: the card says approving sends the action as it was asked — and it does."""
    monkeypatch.setattr(reducer, "CURRENT", reducer.v5.VERSION)
    task, first = _waiting(requester, device)
    _supersede(tenant, _sources(first)[0])
    client.force_login(approver)
    kind, text = _banner(client.get(QUEUE).content.decode())
    assert kind == SENT_AS_ASKED and "sends the action exactly as it was asked" in text
    assert _api(client, first)[1] == SENT_AS_ASKED
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert TaskEvent.objects.filter(task=task, type="intent.committed").count() == 1
    assert task.state["action"]["digest"] == first.action_digest, "sent as it was asked"


def test_a_decision_refused_on_the_card_redraws_it_with_the_notice(
        plans, requester, approver, device, kb, tenant, client):
    task, first = _waiting(requester, device)
    _supersede(tenant, _sources(first)[0])
    client.force_login(approver)
    resp = client.post(f"/approvals/{first.pk}/decide/", {"decision": "reject", "reason": ""}, HTTP_HX_REQUEST="true")
    assert resp.status_code == 422
    html = resp.content.decode()
    first.refresh_from_db()
    assert first.status == "PENDING" and 'value="approve"' in html
    assert _banner(html)[0] == ASKS_AGAIN, "the still decidable card lost the notice"


def test_a_compensation_approval_carries_no_notice(plans, requester, approver, device, kb, tenant, client,
                                                   refservice):
    """Closing a ticket after a cancel does not rest on the evidence, and its resume does not
    re-read it: a compensation approval is not marked, whatever moved."""
    from apps.agent.runner import agent_run
    from tests.conftest import RefAdmin, created_then_cancelled

    task, first = _waiting(requester, device)
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    agent_run(task_id=task.pk)
    task = created_then_cancelled(task.pk, canceller=requester, refadmin=RefAdmin(refservice))
    assert task.status == reducer.COMPENSATING
    compensation = ApprovalRequest.objects.get(task=task, status="PENDING")
    assert compensation.evidence, "it carries the task's evidence"
    _supersede(tenant, _sources(first)[0])
    client.force_login(approver)
    assert _banner(client.get(QUEUE).content.decode()) is None
    assert _api(client, compensation) == ({}, None)


def test_odd_evidence_references_are_skipped_not_a_500(plans, requester, approver, device, kb, tenant):
    task, first = _waiting(requester, device)
    for refs in ([{"chunk_id": "\u00b2"}], [{"chunk_id": "\u0662"}], [{"chunk_id": None}], [{"title": "x"}],
                 ["2"], {"chunk_id": 2}, [{"chunk_id": "-1"}], [{"chunk_id": 2.5}]):
        first.evidence = refs
        assert evidence_moved(principal=p(approver), approvals=[first]) == {}, refs
    first.evidence = [{"chunk_id": "99999999999999"}]  # no such chunk: gone, so no longer readable
    assert evidence_moved(principal=p(approver), approvals=[first])[first.pk].chunks == {"99999999999999": "unreadable"}
