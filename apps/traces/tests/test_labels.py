"""The reader's-language renderings of recorded English (apps/traces/templatetags/labels.py): an
English reader reads exactly what was recorded; a Chinese reader the same facts in Chinese; what
cannot be rebuilt is shown as recorded, never dropped."""

from __future__ import annotations

from types import SimpleNamespace

from django.utils import translation

from apps.traces.templatetags.labels import effects, reason_label, selection_reason, status_label

CREATE = SimpleNamespace(
    tool="ticket.create", object_id="17", object_version=3, params={"device": "UPS-0007", "priority": "P2"},
    side_effects="Creates one ticket in the reference ticket service for UPS-0007 with priority P2. "
                 "A person must approve: security scope cited")
COMMENT = SimpleNamespace(
    tool="ticket.comment", object_id="REF-000001", object_version=4, params={},
    side_effects="Adds one comment to ticket REF-000001 in django-helpdesk, only while the ticket is still at "
                 "version 4 (If-Match); no new ticket.")
CLOSE = SimpleNamespace(
    tool="ticket.update", object_id="REF-000002", object_version=2, params={},
    side_effects="Compensation: closes ticket REF-000002 in the reference ticket service, which was created "
                 "although the request was cancelled; only while the ticket is still at version 2 (If-Match). "
                 "Rejecting leaves the ticket open.")
STATE = {"selection": {"outcome": "answered", "reason": "UPS v1 bears on this report: the device reports "
                                                       "UPS-BATT-017, which it covers.",
                       "primary": {"title": "UPS", "why": "the device reports UPS-BATT-017, which it covers"}},
         "evidence": [{"version": "1"}]}


def test_an_english_reader_reads_exactly_what_was_recorded():
    with translation.override("en"):
        for approval in (CREATE, COMMENT, CLOSE):
            assert effects(approval) == approval.side_effects
        assert selection_reason(STATE) == STATE["selection"]["reason"]
        assert reason_label("dispatch_failed: 503") == "sending failed: 503"


def test_a_chinese_reader_reads_the_same_facts_in_chinese():
    with translation.override("zh-hans"):
        assert effects(CREATE) == ("在参考工单服务中为 UPS-0007 创建一个优先级为 P2 的工单。 "
                                   "必须由人审批：security scope cited")
        comment = effects(COMMENT)
        assert "django-helpdesk" in comment and "REF-000001" in comment and "版本 4" in comment
        assert effects(CLOSE).startswith("补偿：") and "REF-000002" in effects(CLOSE)
        assert selection_reason(STATE) == "《UPS》v1 与此报告相关：设备报告了 UPS-BATT-017，该规程涵盖此告警。"
        assert reason_label("ticket_created") == "已创建工单"
        assert reason_label("dispatch_failed: HTTP 503") == "发送失败: HTTP 503"
        assert status_label("WAITING_APPROVAL") == "等待审批"


def test_what_cannot_be_rebuilt_is_shown_as_recorded():
    odd = SimpleNamespace(tool="ticket.create", object_id="1", object_version=1, params={},
                          side_effects="Something only a newer build writes.")
    with translation.override("zh-hans"):
        assert effects(odd) == odd.side_effects
        unknown = {"selection": {"outcome": "answered", "reason": "X", "primary": {"title": "T", "why": "new why"}},
                   "evidence": [{"version": "1"}]}
        assert selection_reason(unknown) == "X"
        assert reason_label("something_new: x") == "something_new: x"
        assert status_label("NEW_STATUS") == "NEW_STATUS" and reason_label(None) is None


def test_recorded_fixed_reasons_and_dates_read_in_the_readers_language():
    from apps.traces.templatetags.labels import iso_datetime, recorded_reason

    joined = "another report's ticket for this device is being created: this report joins it"
    with translation.override("zh-hans"):
        assert recorded_reason(joined).startswith("此设备的工单正由另一份报告创建")
        assert recorded_reason("a person's own words") == "a person's own words"
    with translation.override("en"):
        assert recorded_reason(joined) == joined
    assert iso_datetime("2026-12-07T17:00:00+08:00").isoformat() == "2026-12-07T09:00:00+00:00"
    assert iso_datetime("not a date") == "not a date" and iso_datetime(None) is None


def test_why_a_person_must_approve_reads_in_the_readers_language_with_one_full_stop():
    from apps.traces.templatetags.labels import no_procedure_reason

    evidence_moved = SimpleNamespace(**{**vars(CREATE), "side_effects": CREATE.side_effects.split(" A person")[0]
                                        + " A person must approve: the evidence behind the earlier approval changed, "
                                          "and with it the action."})
    uncovered = "No procedure in the knowledge base covers this report about a wireless ap as reported."
    unprocedured = SimpleNamespace(**{**vars(CREATE), "side_effects": CREATE.side_effects.split(" A person")[0]
                                      + f" A person must approve: proposed without a procedure: {uncovered}."})
    with translation.override("en"):
        assert effects(evidence_moved) == evidence_moved.side_effects
        assert effects(unprocedured).endswith("as reported.") and ".." not in effects(unprocedured)
    with translation.override("zh-hans"):
        assert effects(evidence_moved).endswith("必须由人审批：先前审批所依据的证据已变化，拟执行的操作也随之改变。")
        assert effects(unprocedured).endswith(
            "必须由人审批：未依据任何处理规程提出：知识库中没有处理规程涵盖这份关于无线接入点的报告。")
        assert "No procedure" not in effects(unprocedured) and ".." not in effects(unprocedured)
        assert no_procedure_reason("You may read no procedures in this tenant.") == "你在此租户中无权读取任何处理规程。"
        assert no_procedure_reason("Something a newer build writes..") == "Something a newer build writes."


def test_the_reasons_an_approval_was_invalidated_or_closed_read_in_chinese():
    from apps.traces.templatetags.labels import recorded_reason

    cases = {
        "the re-validated draft needs no action": "重新验证后的草稿无需任何操作",
        "evidence changed while the task waited: chunk 7 retired — the proposal changed: asked again":
            "任务等待期间证据发生了变化：文档片段 7 已停用——提议已变化：已重新请求审批",
        "device version changed since approval (17 → 18)": "审批后设备版本已变化（17 → 18）",
        "approval expired before a decision": "审批在做出决定前已过期",
        "the task ended (FAILED: deadline_exceeded)": "任务已结束（失败：已超过截止时间）",
    }
    with translation.override("zh-hans"):
        for recorded, chinese in cases.items():
            assert recorded_reason(recorded) == chinese, recorded
        assert recorded_reason("cancelled: the customer called back") == "cancelled: the customer called back", \
            "a person's words stay as written"
    with translation.override("en"):
        for recorded in cases:
            assert recorded_reason(recorded) == recorded
