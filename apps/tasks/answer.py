"""Compose the task's answer from recorded state only (DESIGN.md §1 steps 8–9; spec table 16.5
"receipt recorded, before the answer: rebuild the answer from the receipt").

The three results stay apart: ``knowledge`` (the sourced answer), ``proposal`` (what was proposed
for review) and ``change`` (what the ticket system confirmed with a receipt). ``change`` is only
ever filled from a receipt.
"""

from __future__ import annotations

from apps.evidence.governance import is_chinese
from apps.evidence.guidance import guidance_build

#: the answer's own sentences in the requester's language (quoted procedure text stays as written)
_TEXT = {
    "en": {
        "reports": "{tag} ({kind}) reports {code}",
        "reports_none": "{tag} ({kind}) reports no alert code ({state}).",
        "means": "The procedure says:",
        "stale": "Note: this procedure is stale ({reason}); check it against the device before relying on it.",
        "safety": "Safety first:",
        "steps": "What to do now — {title} v{version}, § {section}:",
        "escalate": "When to escalate:",
        "also": "Also cited:",
        "none": "{reason}",
        "no_steps": "The ticket was proposed without a procedure; a technician will follow up.",
        "done": "What faultdesk did:",
    },
    "zh": {
        "reports": "{tag}（{kind}）报告告警 {code}",
        "reports_none": "{tag}（{kind}）没有告警代码（状态：{state}）。",
        "means": "处理规程中的说明：",
        "stale": "注意：此规程已过期待复核（{reason}），使用前请对照设备确认。",
        "safety": "先注意安全：",
        "steps": "现在怎么做 — 《{title}》v{version}，§ {section}：",
        "escalate": "何时升级：",
        "also": "另见：",
        "none": "{reason}",
        "no_steps": "已在没有处理规程的情况下提出工单，技术人员会跟进。",
        "done": "faultdesk 做了什么：",
    },
}


#: device kinds as a Chinese reader calls them (the English answer says the kind as it is written)
_KIND_ZH = {
    "av": "会议室音视频设备", "badge_reader": "门禁读卡器", "barcode_scanner": "条码扫描枪", "disk_array": "磁盘阵列",
    "door_controller": "门禁控制器", "env_sensor": "环境传感器", "firewall": "防火墙", "hvac_controller": "空调控制器",
    "ip_camera": "网络摄像机", "key_cabinet": "智能钥匙柜", "key_escrow": "密钥托管", "label_printer": "标签打印机",
    "nas": "NAS 存储", "nvr": "网络录像机", "pdu": "PDU 电源分配单元", "printer": "打印机", "server": "服务器",
    "switch": "交换机", "thin_client": "瘦客户端", "ups": "UPS 不间断电源", "wireless_ap": "无线接入点",
}


_STATE_ZH = {"ok": "正常", "degraded": "性能下降", "fault": "故障", "offline": "离线"}


def kind_label(kind: str | None, language: str) -> str:
    """What to call a device of ``kind`` in ``language`` (``"en"`` or ``"zh"``): ``wireless_ap`` is
    "wireless ap" in English and 无线接入点 in Chinese; an unknown kind is written as it is."""
    if language == "zh" and kind in _KIND_ZH:
        return _KIND_ZH[kind]
    return (kind or ("设备" if language == "zh" else "device")).replace("_", " ")


#: Why no procedure was cited, in Chinese, by the reason the relevance check records
#: (``signals.abstention``); the trace and the approval queue render a recorded sentence with it
NO_PROCEDURE_ZH = {
    "no_scopes": "你在此租户中无权读取任何处理规程。",
    "no_content": "报告没有说明出了什么问题，设备也没有报告告警代码，因此无法选择处理规程；会有人向你了解情况。",
    "out_of_scope": "知识库中没有处理规程涵盖这份报告：它说的似乎是{kind}故障以外的事情，设备维护规程不涵盖这类问题。",
    "withheld": "你可读取的处理规程都不涵盖{subject}；你无权读取的范围（{scopes}）中有处理规程涵盖它，"
                "由 {scopes} 团队负责。",
    "uncovered": "知识库中没有处理规程涵盖{subject}。",
}


def reason_zh(selection: dict, device: dict) -> str | None:
    """The Chinese sentence for why nothing was cited, or None when the selection does not say
    why (an event recorded before the check said so; its English reason stands)."""
    signals = selection.get("signals") or {}
    why = signals.get("abstention")
    if why not in NO_PROCEDURE_ZH:
        return None
    kind = kind_label(device.get("kind") or (selection.get("query") or {}).get("device_kind"), "zh")
    code = signals.get("subject_code")
    subject = f"{kind}上的 {code}" if code else f"这份关于{kind}的报告"
    scopes = "、".join((selection.get("withheld") or {}).get("scopes") or [])
    return NO_PROCEDURE_ZH[why].format(kind=kind, subject=subject, scopes=scopes)


def citations_from_evidence(evidence: list[dict]) -> list[dict]:
    """Citations ``{n, chunk_id, document_id, document_title, version, section, source, stale}``
    in retrieval order."""
    return [
        {
            "n": i,
            "chunk_id": ref["chunk_id"],
            "document_id": ref["document_id"],
            "document_title": ref["document_title"],
            "version": ref["version"],
            "section": ref["section"],
            "source": ref["source"],
            "stale": bool(ref.get("stale")),
        }
        for i, ref in enumerate(evidence, start=1)
    ]


def answer_language(state: dict) -> str:
    """``"zh"`` when the requester wrote in Chinese, else ``"en"``."""
    request = state.get("request") or {}
    text = " ".join([request.get("symptom") or "", *(state.get("answers") or [])])
    return "zh" if is_chinese(text) else "en"


def knowledge_compose(state: dict) -> dict:
    """The sourced answer: ``{"text", "citations", "quotes", "outcome", "reason"}``. Every quoted
    line is ``quotes[i]`` — chunk id, version, character range in the chunk's text and the text —
    and carries its citation number in ``text`` as ``[n]``; an answer with no relevant evidence
    says so (``outcome`` ``no_procedure``) and cites nothing. Pure."""
    evidence = state.get("evidence") or []
    device = state.get("device") or {}
    selection = state.get("selection") or {}
    t = _TEXT[answer_language(state)]
    citations = citations_from_evidence(evidence)
    number = {c["chunk_id"]: c["n"] for c in citations}
    alert = device.get("alert_code") or ""
    code = None
    for c in (selection.get("signals") or {}).get("report_codes") or []:
        code = code or c
    guide = guidance_build(evidence, alert_code=code or alert or None)
    quotes: list[dict] = []
    lines: list[str] = []

    def q(quote) -> str:
        quotes.append({**quote.as_dict(), "n": number[quote.chunk_id]})
        return f"“{quote.text}” [{number[quote.chunk_id]}]"

    kind = kind_label(device.get("kind"), answer_language(state))
    if device:
        if alert:
            line = t["reports"].format(tag=device.get("asset_tag"), kind=kind, code=alert)
            if device.get("alert_message"):
                line += f" — {device['alert_message']}"
            lines.append(line + ("。" if t is _TEXT["zh"] else "."))
        else:
            state_word = device.get("state")
            if t is _TEXT["zh"]:
                state_word = _STATE_ZH.get(state_word, state_word)
            lines.append(t["reports_none"].format(tag=device.get("asset_tag"), kind=kind, state=state_word))
    outcome = selection.get("outcome") or ("answered" if evidence else "no_procedure")
    if not evidence:
        reason = selection.get("reason") or "No procedure you may read covers this report."
        if t is _TEXT["zh"]:
            reason = reason_zh(selection, device) or reason
        lines += [t["none"].format(reason=reason), t["no_steps"]]
    else:
        reason = selection.get("reason", "")
        doc = guide["document"]
        if guide["code"] is not None:
            lines.append(f"{t['means']} {q(guide['code'])}")
        if doc["stale"]:
            lines.append(t["stale"].format(reason=doc["stale_reason"]))
        if guide["safety"]:
            lines.append(t["safety"])
            lines += [f"  ! {q(s)}" for s in guide["safety"]]
        if guide["steps"]:
            section = guide["steps"][0].section
            lines.append(t["steps"].format(title=doc["title"], version=doc["version"], section=section))
            lines += [f"  {i}. {q(s)}" for i, s in enumerate(guide["steps"], start=1)]
        if guide["escalation"]:
            lines.append(t["escalate"])
            lines += [f"  - {q(s)}" for s in guide["escalation"]]
        others = [c for c in citations if c["document_id"] != evidence[0]["document_id"]]
        if others:
            lines.append(t["also"] + " " + "; ".join(
                f"[{c['n']}] {c['document_title']} v{c['version']} § {c['section']}" for c in others))
    return {"text": "\n".join(lines), "citations": citations, "quotes": quotes, "outcome": outcome,
            "reason": reason, "language": answer_language(state), "done_label": t["done"]}


_NOTES = {
    "en": {"comment": "Your report was added to the open ticket {ticket} as comment {comment} (receipt recorded, "
                      "ticket version {version}); no second ticket was created.",
           "created": "Ticket {ticket} was created (receipt recorded, version {version}).",
           "rejected": "No ticket was created: the approver rejected the proposed ticket.",
           "none": "No ticket has been created."},
    "zh": {"comment": "你的报告已作为评论 {comment} 添加到未关闭的工单 {ticket}（回执已记录，工单版本 {version}）；"
                      "没有创建第二张工单。",
           "created": "已创建工单 {ticket}（回执已记录，版本 {version}）。",
           "rejected": "没有创建工单：审批人拒绝了提议的工单。",
           "none": "尚未创建工单。"},
}


def change_and_note(state: dict) -> tuple[dict | None, str]:
    """What the ticket system confirmed (only from a receipt) and one sentence, in the
    requester's language, saying what faultdesk did: a ticket, a comment, nothing, or a rejected
    proposal."""
    notes = _NOTES[answer_language(state)]
    receipt = state.get("receipt")
    if receipt and receipt.get("kind") == "comment":
        change = {"ticket_id": receipt["ticket_id"], "ticket_version": receipt["version"], "comment_id":
                  receipt["external_id"], "connector": receipt.get("connector", "reference"), "status": "commented"}
        return change, notes["comment"].format(ticket=receipt["ticket_id"], comment=receipt["external_id"],
                                               version=receipt["version"])
    if receipt:
        change = {"ticket_id": receipt["external_id"], "ticket_version": receipt["version"],
                  "connector": receipt.get("connector", "reference"), "status": receipt.get("status")}
        return change, notes["created"].format(ticket=receipt["external_id"], version=receipt["version"])
    if (state.get("termination_reason") or "") == "proposal_rejected":
        return None, notes["rejected"]
    return None, notes["none"]


def completion_event(state: dict) -> tuple[str, dict] | None:
    """The event that completes a task once its receipt is recorded (DESIGN.md §1 step 8: the
    answer says "created" only with a receipt): ``("task.completed", {"reason", "answer"})`` for a
    task in DISPATCHING whose receipt is in ``state``, else None. Pure: the runner's step and the
    outbox's receipt transaction append the same event."""
    receipt = state.get("receipt")
    if state.get("status") != "DISPATCHING" or receipt is None:
        return None
    reason = "ticket_commented" if receipt.get("kind") == "comment" else "ticket_created"
    return "task.completed", {"reason": reason, "answer": answer_compose(state)}


def answer_compose(state: dict) -> dict:
    """Build ``{"knowledge": {"text", "citations", "quotes", "outcome", "reason", "language"},
    "proposal": {...}|None, "change": {...}|None, "status_note": str}`` from a reducer state.
    Pure: same state, same answer. ``knowledge.text`` ends with what faultdesk did (a ticket, a
    comment, nothing, or an outcome not yet confirmed)."""
    knowledge = knowledge_compose(state)
    change, note = change_and_note(state)
    knowledge["text"] += f"\n{knowledge.pop('done_label')} {note}"
    proposal = state.get("proposal")
    return {
        "knowledge": knowledge,
        "proposal": (
            {"tool": proposal["tool"], "params": proposal["params"], "digest": proposal["digest"]}
            if proposal else None
        ),
        "change": change,
        "status_note": note,
    }
