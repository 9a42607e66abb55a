"""What a card on the approver's queue says about the approval it shows (templates/approvals/_row.html):
a past approval — decided, invalidated, expired, or one its task has moved past (a newer approval
asked) — is headed by the evidence it recorded itself, never by what the task found later; only the
pending approval the task waits on now is headed by the task's selection. On a Chinese page the
recorded English sentences — why a person must approve, why an approval was invalidated or closed —
read in Chinese, and so does the API's 409 for an approval already decided."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone, translation

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
ZH = {"HTTP_ACCEPT_LANGUAGE": "zh-hans"}
#: what the task found after it re-planned: another document, in another language
LATER = {"outcome": "answered", "reason": "Later Manual v4 bears on this report: it matches the report best.",
         "primary": {"title": "Later Manual", "why": "it matches the report best"}}


@pytest.fixture(autouse=True)
def _english_afterwards():
    yield
    translation.deactivate()


def _card(page: str, approval_id) -> str:
    start = page.index(f'id="approval-{approval_id}"')
    return page[start:page.index("</article>", start)]


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _waiting(requester, device) -> tuple[Task, ApprovalRequest]:
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    return task, ApprovalRequest.objects.get(task=task)


def _replanned(task: Task, selection: dict, evidence: list[dict]) -> None:
    """The task's state as a later re-plan left it (its row only, on purpose)."""
    Task.objects.filter(pk=task.pk).update(state={**task.state, "selection": selection, "evidence": evidence})


@pytest.mark.allow_divergence  # the task's state is set to what a later re-plan would leave, on purpose
def test_a_past_approval_is_headed_by_the_evidence_it_cited_not_by_the_tasks_later_selection(
        client, requester, approver, device, kb, refservice):
    task, approval = _waiting(requester, device)
    cited = approval.evidence[0]
    ApprovalRequest.objects.filter(pk=approval.pk).update(
        status=ApprovalStatus.INVALIDATED,
        reason="evidence changed while the task waited: chunk 1 retired — the proposal changed: asked again")
    _replanned(task, LATER, [{"version": 4, "document_title": "Later Manual"}])
    client.force_login(approver)
    for headers, heading in (({}, "Evidence cited when it was asked: "), (ZH, "提出时所引证据：")):
        card = _text(_card(client.get(reverse("approval-queue") + "?status=INVALIDATED", **headers).content.decode(),
                           approval.pk))
        cited_as = (f"《{cited['document_title']}》v{cited['version']}" if headers
                    else f"{cited['document_title']} v{cited['version']}")
        assert f"{heading}{cited_as}" in card
        assert "Later Manual" not in card, "the task's later evidence is not what this approval cited"
        assert f"({len(approval.evidence)})" in card or f"（{len(approval.evidence)}）" in card
    # the task's later selection found nothing: the approval still cited what it cited
    _replanned(task, {"outcome": "no_procedure", "reason": "No procedure in the knowledge base covers E-9 on a "
                                                             "printer as reported."}, [])
    card = _text(_card(client.get(reverse("approval-queue") + "?status=INVALIDATED").content.decode(), approval.pk))
    assert "No procedure cited" not in card and f"{cited['document_title']} v{cited['version']}" in card


@pytest.mark.allow_divergence
def test_only_the_pending_approval_the_task_waits_on_is_headed_by_the_tasks_selection(
        client, requester, approver, device, kb, refservice):
    task, approval = _waiting(requester, device)
    client.force_login(approver)
    card = _text(_card(client.get(reverse("approval-queue")).content.decode(), approval.pk))
    assert f"Evidence: {task.state['selection']['reason']}" in card, "the current approval: as before"
    # the task asked again since (a newer approval): this one no longer speaks for the task's state
    newer = ApprovalRequest.objects.create(**{f.attname: getattr(approval, f.attname) for f in approval._meta.fields
                                              if f.attname not in ("id", "created_at")})
    _replanned(task, LATER, [{"version": 4, "document_title": "Later Manual"}])
    page = client.get(reverse("approval-queue")).content.decode()
    old = _text(_card(page, approval.pk))
    assert "Later Manual" not in old and "Evidence cited when it was asked: " in old
    assert "Later Manual" not in _text(_card(page, newer.pk)), "not the task's current approval either"


def _row(tenant, requester, device, *, status, side_effects, reason="", evidence=()) -> ApprovalRequest:
    now = timezone.now()
    task = Task.objects.create(tenant=tenant, requester=requester, device=device, symptom="report",
                               status=reducer.WAITING_APPROVAL, deadline_at=now + timedelta(hours=1),
                               budget_total=100, artifact_bundle={}, request_digest="x", state=reducer.initial_state())
    return ApprovalRequest.objects.create(
        tenant=tenant, task=task, requested_by=requester, tool="ticket.create", tool_version="1",
        params={"title": "t", "priority": "P2", "description": "d", "labels": []}, action_digest="0" * 64,
        object_type="device", object_id=str(device.pk), object_version=device.version, policy_version=1,
        scope="acme:ticket.create", side_effects=side_effects, evidence=list(evidence), status=status, reason=reason,
        expires_at=now + timedelta(hours=1), approver_roles=["approver", "admin"])


CREATES = "Creates one ticket in the reference ticket service for PRN-0001 with priority P2."
WITHHELD = ("No procedure you may read covers E-204 on a printer; a procedure in a scope you cannot read (tier3) "
            "covers it, and the tier3 team holds it.")


@pytest.mark.allow_divergence  # rows written directly: no events
def test_why_a_person_must_approve_and_why_it_was_closed_read_in_chinese(client, tenant, requester, approver,
                                                                        device):
    forced = _row(tenant, requester, device, status=ApprovalStatus.INVALIDATED,
                  side_effects=f"{CREATES} A person must approve: the evidence behind the earlier approval changed, "
                               "and with it the action.",
                  reason="premises changed while the task waited for its approval: device_version, device_profile "
                         "— the proposal changed: asked again")
    unprocedured = _row(tenant, requester, device, status=ApprovalStatus.INVALIDATED,
                        side_effects=f"{CREATES} A person must approve: proposed without a procedure: {WITHHELD}.",
                        reason="policy changed since approval (v1 → v2): only admin may approve ticket.create now")
    asks = _row(tenant, requester, device, status=ApprovalStatus.INVALIDATED, side_effects=CREATES,
                reason="the re-validated draft asks the requester first")
    client.force_login(approver)
    page = client.get(reverse("approval-queue") + "?status=INVALIDATED", **ZH).content.decode()
    one, two, three = (_text(_card(page, a.pk)) for a in (forced, unprocedured, asks))
    assert "必须由人审批：先前审批所依据的证据已变化，拟执行的操作也随之改变。" in one
    assert "任务等待审批期间前提发生了变化：设备版本、设备概况（类型、告警）——提议已变化：已重新请求审批" in one
    assert "必须由人审批：未依据任何处理规程提出：你可读取的处理规程都不涵盖打印机上的 E-204；" in two
    assert "审批后审批策略已变化（v1 → v2）：现在只有管理员可以审批 ticket.create" in two
    assert "重新验证后的草稿需先询问申请人" in three
    for english in ("the evidence behind the earlier approval", "premises changed while", "device_version",
                    "the proposal changed", "No procedure you may read", "。.", "policy changed since",
                    "asks the requester first"):
        assert english not in one + two + three, english
    # an English reader reads what was recorded, with one full stop
    page = client.get(reverse("approval-queue") + "?status=INVALIDATED").content.decode()
    assert f"proposed without a procedure: {WITHHELD}" in _text(_card(page, unprocedured.pk))
    assert "holds it.." not in _text(_card(page, unprocedured.pk))


@pytest.mark.allow_divergence
def test_a_decision_on_a_closed_approval_is_refused_with_its_status_named(client, tenant, requester, approver,
                                                                         device):
    closed = _row(tenant, requester, device, status=ApprovalStatus.INVALIDATED, side_effects=CREATES,
                  reason="the task was cancelled")
    client.force_login(approver)
    url = f"/api/approvals/{closed.pk}/decision/"
    zh = client.post(url, {"decision": "approve"}, content_type="application/json", **ZH)
    en = client.post(url, {"decision": "approve"}, content_type="application/json")
    assert zh.status_code == en.status_code == 409
    assert zh.json()["detail"] == "该审批已处于“已失效”状态" and "INVALIDATED" not in zh.json()["detail"]
    assert en.json()["detail"] == "approval is already invalidated"
    assert zh.json()["status"] == en.json()["status"] == "INVALIDATED", "the machine-readable code stays"


@pytest.mark.allow_divergence
def test_the_queue_of_past_approvals_costs_the_same_queries_for_few_and_many(client, tenant, requester, approver,
                                                                            device):
    def rows(n):
        for i in range(n):
            _row(tenant, requester, device, status=ApprovalStatus.INVALIDATED, side_effects=CREATES,
                 reason="the task was cancelled",
                 evidence=[{"chunk_id": i, "document_title": f"Doc {i}", "version": 1, "excerpt": "x"}])

    def queries():
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(reverse("approval-queue") + "?status=ALL").status_code == 200
        return len(ctx.captured_queries)

    client.force_login(approver)
    rows(3)
    few = queries()
    rows(25)
    assert queries() == few
