"""The trace's plan versions side by side (``reducer/6``; apps/traces/selectors.py, templates/traces/_plans.html):
a task re-planned twice through the real runtime — the device moved on while its reads were in flight,
then a cited document was superseded while the approval waited — shows one column per version, each
changed premise marked, each barrier's why, continuing and cancelled steps, and each read's verdict, in
English and in Chinese; the timeline gives each plan event one line. A task of an earlier reducer has
no such section. The section costs two queries whatever the number of versions, shows chunk ids (never
excerpts) and links only those the viewer may read, and only to the task's tenant's admins."""

from __future__ import annotations

import html
import re

import pytest
from django.db import connection
from django.template.loader import render_to_string
from django.test.utils import CaptureQueriesContext
from django.utils import translation

from apps.accounts.models import AccessScope, Role
from apps.agent.runner import context_read, read_activity_run
from apps.approvals.models import ApprovalPolicy, ApprovalRequest
from apps.approvals.rules import DEFAULT_RULES
from apps.approvals.services import approval_decide
from apps.devices.services import device_update_state
from apps.evidence.services import document_ingest
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from apps.traces.selectors import plan_columns, plan_versions
from tests.conftest import KB, drive, p
from tests.factories import MembershipFactory, UserFactory

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _replanned(requester, approver, device, tenant) -> Task:
    """A task with three plan versions, built by the runtime: v1's reads are dispatched; the device
    moves on (its version, not what retrieval filters on) and the approval policy gets a new version
    before any read reports; the device read finds the device moved and activates v2 (the ticket
    read and retrieval, depending on neither, continue in flight); the old device, ticket and
    retrieval reads are re-validated. Then, while the approval waits,
    the cited procedure gets a new version: granting the approval activates v3 (the device and
    ticket reads continue joined, retrieval is done again and accepted)."""
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    context_read(task_id=task.pk)
    first = {a["step"]: aid for aid, a in Task.objects.get(pk=task.pk).state["activities"].items()}
    device_update_state(device=device, site="Building 2")
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules=DEFAULT_RULES, active=True)
    for step in ("device", "ticket", "retrieval"):  # the order a slow ticket system and retrieval give
        read_activity_run(task_id=task.pk, activity_id=first[step])
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL and len(task.state["plans"]) == 2
    source = next(r["source"] for r in task.state["evidence"] if r["source"].startswith("tier2/"))
    document_ingest(tenant=tenant, source=source, scope="tier2",
                    raw=(KB / source).read_text() + "\n\nStep 9: if the error returns, call the vendor.\n")
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve", reason="ok")
    task = drive(task.pk)
    assert len(task.state["plans"]) == 3
    return task


def _section(page: str) -> str:
    start = page.index('<section id="plans">')
    return page[start:page.index("</section>", start)]


def _row(section: str, css: str) -> list[tuple[bool, str]]:
    """The cells of the row ``css`` as ``(marked changed, text)``, in version order (a premise set
    for the first time is not marked changed: its text says "set")."""
    row = re.search(rf'<tr class="{css}">(.*?)</tr>', section, re.S).group(1)
    cells = re.findall(r'<td(?: class="(changed|set)")?>(.*?)</td>', row, re.S)
    return [(mark == "changed", _text(cell)) for mark, cell in cells]


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _summaries(page: str) -> list[str]:
    return [html.unescape(s) for s in re.findall(r'<span class="summary">(.*?)</span>', page)]


@pytest.fixture
def replanned(requester, approver, device, kb, refservice, tenant, plans_reducer, reads_as_activities):
    return _replanned(requester, approver, device, tenant)


def test_the_trace_shows_the_plan_versions_side_by_side_with_barriers_and_verdicts(client, replanned, admin_user):
    client.force_login(admin_user)
    page = client.get(f"/tasks/{replanned.pk}/trace/").content.decode()
    plans = _section(page)
    assert [_text(h) for h in re.findall(r'<th scope="col">(.*?)</th>', plans)] == [
        "premise", "version 1", "version 2", "version 3 (in force)"]
    # each premise in each version, marked where it differs from the version before
    assert _row(plans, "premise-device_version") == [(False, "v17"), (True, "v18 changed"), (False, "v18")]
    assert _row(plans, "premise-policy_version") == [(False, "v1"), (True, "v2 changed"), (False, "v2")]
    assert _row(plans, "premise-approver_role") == [(False, "—"), (False, "—"), (False, "Approver set")]
    assert [changed for changed, _ in _row(plans, "premise-request")] == [False, False, False]
    assert [changed for changed, _ in _row(plans, "premise-device_profile")] == [False, False, False]
    chunks = replanned.state["plans"][2]["premises"]["evidence"]
    [(_, none1), (_, none2), (marked, carried)] = _row(plans, "premise-evidence")
    assert none1 == none2 == "none carried: retrieves afresh" and marked
    for cid, status in chunks.items():  # chunk ids with their status, each a link for an admin who may read it
        assert f"chunk {cid} · {status}" in carried and f'href="/evidence/{cid}/"' in plans
    assert sorted(set(chunks.values())) == ["current", "superseded"]
    # the reason and the barrier of each version
    assert _row(plans, "plan-reason") == [
        (False, "the report was accepted"), (False, "the device read found premises moved on: device_version"),
        (False, "evidence changed while the task waited: " + ", ".join(
            f"chunk {c} superseded" for c, s in sorted(chunks.items()) if s == "superseded"))]
    [(_, b1), (_, b2), (_, b3)] = _row(plans, "plan-barrier")
    assert b1 == "none: the first version"
    assert b2 == ("replaces version 1: the device read found premises moved on: device_version "
                  "continuing: open-ticket read (still in flight), retrieval (still in flight) "
                  "cancelled: device read, draft, authorization, write")
    assert b3.startswith("replaces version 2: evidence changed while the task waited: chunk ")
    assert b3.endswith("continuing: device read (joined), open-ticket read (joined) "
                       "cancelled: retrieval, draft, authorization, write")
    # each version's read activities with their verdicts
    [(_, v1), (_, v2), (_, v3)] = _row(plans, "plan-activities")
    assert re.search(r"device read · re-validated \(judged under version 2\) · event \d+ · \S+ after approval policy "
                     r"version changed, checked the device's object version", v1)
    assert re.search(r"open-ticket read · re-validated \(judged under version 2\) · event \d+ · \S+ after device "
                     r"version, approval policy version changed", v1)
    assert re.search(r"retrieval · re-validated \(judged under version 2\) · event \d+ · \S+ after approval policy "
                     r"version changed, checked every chunk retrieved is current and readable by the requester", v1)
    assert v2 == "none dispatched under this version", "its reads were in flight already"
    assert re.fullmatch(r"retrieval · accepted · event \d+ · \S+", v3)
    # recorded data only: no document excerpt reaches the section
    excerpt = next(r["excerpt"] for r in replanned.state["evidence"])[:40]
    assert html.escape(excerpt) not in plans
    # the timeline: one line per plan event
    lines = _summaries(page)
    assert "plan v1: the report was accepted" in lines
    assert ("plan v2 replaces v1: the device read found premises moved on: device_version · continuing: "
            "open-ticket read (still in flight), retrieval (still in flight) · cancelled: device read, draft, "
            "authorization, write") in lines
    assert any(line.startswith("open-ticket read of plan v1: re-validated") for line in lines)
    assert "device read of plan v1: re-validated (checked the device's object version)" in lines
    assert "retrieval of plan v3: accepted" in lines
    assert "dispatches the retrieval under plan v3" in lines
    phases = re.findall(r'class="phase-start"><td>\d+</td><td><strong>([^<]+)</strong>', page)
    assert phases[:4] == ["request", "evidence and device", "re-plan", "evidence and device"]
    assert phases.count("re-plan") == 2


def test_the_plan_versions_read_in_chinese(client, replanned, admin_user):
    client.force_login(admin_user)
    page = client.get(f"/tasks/{replanned.pk}/trace/", HTTP_ACCEPT_LANGUAGE="zh-hans").content.decode()
    plans = _section(page)
    assert "计划版本" in plans and "版本 3 (生效中)" in _text(plans)
    assert _row(plans, "premise-device_version") == [(False, "v17"), (True, "v18 已变化"), (False, "v18")]
    assert _row(plans, "premise-approver_role")[2] == (False, "审批人 已确定")
    assert _row(plans, "plan-reason")[:2] == [(False, "报告已受理"), (False, "设备读取发现前提已变化：设备版本")]
    assert _row(plans, "plan-reason")[2][1].startswith("任务等待期间证据发生了变化：文档片段 ")
    [(_, b1), (_, b2), (_, b3)] = _row(plans, "plan-barrier")
    assert b1 == "无：这是第一个版本"
    assert b2 == ("取代版本 1：设备读取发现前提已变化：设备版本 继续： 未结工单读取（仍在进行中）、检索（仍在进行中） "
                  "取消： 设备读取、起草、授权、写入")
    assert b3.endswith("继续： 设备读取（已汇合）、未结工单读取（已汇合） 取消： 检索、起草、授权、写入")
    [(_, v1), (_, v2), (_, v3)] = _row(plans, "plan-activities")
    assert "设备读取 · 已重新验证 （按版本 2 判定）" in v1 and "审批策略版本变化之后，核对了设备的对象版本" in v1
    assert "未结工单读取 · 已重新验证" in v1
    assert "核对了检索到的每个文档片段都是现行版本，且申请人可以读取" in v1
    assert v2 == "此版本下未派发任何读取" and v3.startswith("检索 · 已接受")
    assert "已被取代" in _row(plans, "premise-evidence")[2][1]
    lines = _summaries(page)
    assert "计划 v1：报告已受理" in lines
    assert ("计划 v2 取代 v1：设备读取发现前提已变化：设备版本 · "
            "继续：未结工单读取（仍在进行中）、检索（仍在进行中） · 取消：设备读取、起草、授权、写入") in lines
    assert "计划 v1 的设备读取：已重新验证（核对了设备的对象版本）" in lines
    assert "重新规划" in re.findall(r'class="phase-start"><td>\d+</td><td><strong>([^<]+)</strong>', page)


def test_the_export_carries_the_versions_and_only_the_tenants_admin_sees_them(client, replanned, admin_user,
                                                                            requester, other_tenant_user):
    client.force_login(admin_user)
    doc = client.get(f"/tasks/{replanned.pk}/trace.json").json()
    versions = doc["plans"]
    assert [v["version"] for v in versions] == [1, 2, 3]
    assert versions[1]["changed"] == ["device_version", "policy_version"]
    assert versions[1]["barrier"]["continuing"] == {"ticket": "in_flight", "retrieval": "in_flight"}
    assert [(a["step"], a["status"]) for a in versions[0]["activities"]] == [
        ("device", "revalidated"), ("ticket", "revalidated"), ("retrieval", "revalidated")]
    assert versions[0]["activities"][1]["judged_under"] == 2 and versions[1]["activities"] == []
    assert versions[0]["activities"][0]["changed"] == ["policy_version"]
    assert versions[0]["activities"][0]["revalidation"]["checked"] == "the device's object version"
    assert [(a["step"], a["status"]) for a in versions[2]["activities"]] == [("retrieval", "accepted")]
    for user in (requester, other_tenant_user):
        client.force_login(user)
        assert client.get(f"/tasks/{replanned.pk}/trace/").status_code == 404
        assert client.get(f"/tasks/{replanned.pk}/trace.json").status_code == 404


def test_a_chunk_outside_the_viewers_scopes_is_named_not_linked(client, replanned, tenant):
    public_admin = UserFactory(username="ada")
    MembershipFactory(user=public_admin, tenant=tenant, role=Role.ADMIN, scopes=[AccessScope.PUBLIC])
    client.force_login(public_admin)
    plans = _section(client.get(f"/tasks/{replanned.pk}/trace/").content.decode())
    carried = _row(plans, "premise-evidence")[2][1]
    chunks = replanned.state["plans"][2]["premises"]["evidence"]
    for cid in chunks:
        tier2 = chunks[cid] == "superseded"  # the superseded procedure is tier2; the paper-jam one public
        assert (f'href="/evidence/{cid}/"' in plans) is not tier2
        assert (f"chunk {cid} (outside your scopes)" in carried) is tier2


def test_the_section_costs_two_queries_whatever_the_versions(client, replanned, admin_user, requester, device,
                                                             monkeypatch, django_assert_num_queries):
    viewer = p(admin_user)
    with django_assert_num_queries(2):  # the reports of the reads; the premises' chunks the viewer may read
        trace = plan_versions(principal=viewer, task=replanned)
    assert len(trace.columns) == 3 and sum(len(c.activities) for c in trace.columns) == 4
    # the whole page: the same as an earlier reducer's task waiting for its approval, plus those two
    monkeypatch.setattr(reducer, "CURRENT", "reducer/5")
    old = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task.pk)
    assert old.status == replanned.status == reducer.WAITING_APPROVAL
    client.force_login(admin_user)
    counts = {}
    for task in (old, replanned):
        with CaptureQueriesContext(connection) as queries:
            assert client.get(f"/tasks/{task.pk}/trace/").status_code == 200
        counts[task.pk] = len(queries.captured_queries)
    assert counts[replanned.pk] == counts[old.pk] + 2


def test_a_task_of_an_earlier_reducer_has_no_plan_section(client, requester, device, kb, admin_user, monkeypatch,
                                                          django_assert_num_queries):
    monkeypatch.setattr(reducer, "CURRENT", "reducer/5")
    task = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task.pk)
    assert task.artifact_bundle["reducer"] == "reducer/5" and task.status == reducer.WAITING_APPROVAL
    viewer = p(admin_user)
    with django_assert_num_queries(0):
        assert plan_versions(principal=viewer, task=task) is None
    client.force_login(admin_user)
    page = client.get(f"/tasks/{task.pk}/trace/").content.decode()
    assert 'id="plans"' not in page and "Plan versions" not in page and "<code>evidence.retrieved</code>" in page
    assert _summaries(page) == []
    assert "plans" not in client.get(f"/tasks/{task.pk}/trace.json").json()


#: a state with two versions whose reads failed and lapsed (what the runtime records; plan_columns is pure)
_PREMISES = {"request": "r1", "scopes": ["public"], "requester_role": "requester", "device_version": 3,
             "device_profile": None, "policy_version": 1, "bundle": "b1", "approver_role": None,
             "ticket_epoch": 0, "evidence": None}
STATE = {
    "plans": [{"version": 1, "premises": _PREMISES, "reason": "the report was accepted", "barrier": None},
              {"version": 2, "premises": {**_PREMISES, "ticket_epoch": 1}, "reason": "dispatch.conflict",
               "barrier": {"from_version": 1, "why": "dispatch.conflict: the ticket changed since the approval (412)",
                           "continuing": {}, "cancelled": ["device", "ticket", "retrieval", "draft", "authorize",
                                                            "write"]}}],
    "activities": {"t1": {"step": "ticket", "plan_version": 1, "status": "failed"},
                   "d1": {"step": "device", "plan_version": 1, "status": "lapsed"},
                   "d2": {"step": "device", "plan_version": 2, "status": "dispatched"},
                   "t2": {"step": "ticket", "plan_version": 2, "status": "dispatched"}},
}
REPORTS = [
    {"seq": 3, "type": "plan.activated", "version": 1},
    {"seq": 6, "type": "read.failed", "activity_id": "t1",
     "error": "the ticket system cannot be read now: connection refused"},
    {"seq": 7, "type": "budget.settled", "reservation_id": "d1", "unknown_outcome": True,
     "reason": "the device read did not report by its deadline: charged at its reservation, read again"},
    {"seq": 9, "type": "plan.activated", "version": 2},
    {"seq": 12, "type": "budget.settled", "reservation_id": "t2",
     "reason": "the ticket read reported when nothing waited for it"},
]


def test_failed_lapsed_in_flight_and_unjoined_reads_read_as_such_in_both_languages():
    trace = plan_columns(STATE, REPORTS, set())
    v1, v2 = trace.columns
    assert [(a.step, a.status, a.seq) for a in v1.activities] == [("device", "lapsed", None), ("ticket", "failed", 6)]
    assert v1.activities[0].settled.startswith("the device read did not report by its deadline")
    assert [(a.step, a.status) for a in v2.activities] == [("device", "dispatched"), ("ticket", "unjoined")]
    assert v2.changed == ["ticket_epoch"]
    for language, expected in (
            ("en", ["device read · lapsed", "the device read did not report by its deadline: charged at its "
                    "reservation, read again", "open-ticket read · failed", "the ticket system cannot be read now: "
                    "connection refused", "device read · in flight", "open-ticket read · not joined",
                    "the ticket read reported when nothing waited for it",
                    "dispatch.conflict: the ticket changed since the approval (412)"]),
            ("zh-hans", ["设备读取 · 已超时", "设备读取未在截止时间前回报：按预留额度计费，并重新读取",
                         "未结工单读取 · 失败", "暂时无法读取工单系统：connection refused", "设备读取 · 进行中",
                         "未结工单读取 · 未汇合", "未结工单读取回报时已无步骤等待它：只记录了其费用",
                         "发送时工单已发生变化：审批后工单已发生变化（412）"])):
        with translation.override(language):
            text = _text(render_to_string("traces/_plans.html", {"plans": trace}))
        for words in expected:
            assert words in text, (language, words)


#: the barrier whys and plan reasons the runtime records when it re-plans at resume (apps/agent/authorization.py)
#: and after an approval was invalidated (apps/agent/reads.py: "<event>: <reason>")
RESUMED = {
    "plans": [{"version": 1, "premises": _PREMISES, "reason": "the report was accepted", "barrier": None},
              {"version": 2, "premises": {**_PREMISES, "device_version": 4, "approver_role": "approver"},
               "reason": "premises changed while the task waited for its approval: device_version, device_profile",
               "barrier": {"from_version": 1, "why": "premises changed while the task waited for its approval: "
                                                     "device_version, device_profile", "continuing": {},
                           "cancelled": ["device"]}},
              {"version": 3, "premises": {**_PREMISES, "device_version": 4, "approver_role": "approver",
                                          "policy_version": 2},
               "reason": "policy changed since approval (v1 → v2): only admin may approve ticket.create now",
               "barrier": {"from_version": 2, "why": "approval.invalidated: policy changed since approval (v1 → v2): "
                                                     "only admin may approve ticket.create now",
                           "continuing": {}, "cancelled": []}},
              {"version": 4, "premises": {**_PREMISES, "device_version": 4, "approver_role": "admin",
                                          "policy_version": 2},
               "reason": "requester's permissions changed: cited evidence no longer readable",
               "barrier": {"from_version": 3, "why": "approval.invalidated: requester's permissions changed: cited "
                                                     "evidence no longer readable", "continuing": {},
                           "cancelled": []}}],
    "activities": {},
}


def test_the_reasons_a_task_re_planned_at_resume_read_in_chinese_with_premises_named():
    trace = plan_columns(RESUMED, [], set())
    with translation.override("zh-hans"):
        plans = render_to_string("traces/_plans.html", {"plans": trace})
    reasons, barriers = [t for _, t in _row(plans, "plan-reason")], [t for _, t in _row(plans, "plan-barrier")]
    assert reasons[1] == "任务等待审批期间前提发生了变化：设备版本、设备概况（类型、告警）"
    assert reasons[2] == "审批后审批策略已变化（v1 → v2）：现在只有管理员可以审批 ticket.create"
    assert reasons[3] == "申请人的权限已变化：所引证据已不可读取"
    assert barriers[1].startswith("取代版本 1：任务等待审批期间前提发生了变化：设备版本、设备概况（类型、告警）")
    assert barriers[2].startswith("取代版本 2：审批已失效：审批后审批策略已变化（v1 → v2）：现在只有管理员可以审批")
    assert barriers[3].startswith("取代版本 3：审批已失效：申请人的权限已变化：所引证据已不可读取")
    text = _text(plans)
    for english in ("premises changed", "device_version", "device_profile", "policy changed", "only admin",
                    "requester's permissions", "approval.invalidated"):
        assert english not in text, english
    with translation.override("en"):
        text = _text(render_to_string("traces/_plans.html", {"plans": trace}))
    assert "premises changed while the task waited for its approval: device_version, device_profile" in text


def test_a_premise_set_for_the_first_time_reads_as_set_not_as_changed():
    trace = plan_columns(RESUMED, [], set())
    for language, role, set_mark, changed_mark in (("en", "Approver", "Approver set", "Admin changed"),
                                                   ("zh-hans", "审批人", "审批人 已确定", "管理员 已变化")):
        with translation.override(language):
            plans = render_to_string("traces/_plans.html", {"plans": trace})
        # v1 had no approver yet: v2 sets one (not a change); v4's is another one (a change)
        assert _row(plans, "premise-approver_role") == [(False, "—"), (False, set_mark), (False, role),
                                                        (True, changed_mark)]
    assert trace.columns[1].changed == ["device_version", "approver_role"], "what is recorded as changed stays"
