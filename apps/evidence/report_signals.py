"""What a report says, apart from the documents it is matched with (DESIGN.md §9; spec §16.6).

:func:`apps.evidence.relevance.evidence_select` decides on these signals of the report itself:

* the alert codes it names (:func:`report_codes`) and whether it names the subject of the device's
  own alert (:func:`names_alert_subject`);
* how vague it is (:func:`vagueness`: its similarity to generic complaints);
* whether it is about something a device-maintenance desk does not handle: its similarity to the
  service catalogue's exclusions (:func:`topic_similarity`) and the excluded object it names as
  its subject (:func:`excluded_subject`).

Both lists of exclusions are settings (``FAULTDESK["OUT_OF_SCOPE_TOPICS"]`` and
``FAULTDESK["OUT_OF_SCOPE_TERMS"]``); the defaults are a maintenance desk's.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
from django.conf import settings

from apps.evidence.embedding import embed_texts
from apps.evidence.governance import is_chinese
from apps.evidence.textsearch import cjk_words

#: Generic complaints: reports that say something is wrong without saying what.
GENERIC_COMPLAINTS = (
    "it is broken and not working",
    "the device shows an error and does not work",
    "there is an alarm on it, please fix",
    "something is wrong with it again",
    "error light is on, please help",
    "坏了，不能用了",
    "设备报错了，请处理",
    "又出问题了，有告警",
)

#: What a device-maintenance desk does not handle (its service catalogue's exclusions): a report
#: closer to one of these than to any candidate procedure is about something no procedure covers.
#: ``FAULTDESK["OUT_OF_SCOPE_TOPICS"]`` replaces them.
OUT_OF_SCOPE_TOPICS = (
    "office furniture: chairs, desks, monitor arms, window blinds, lockers",
    "kitchen and building fittings: taps, sinks, coffee machines, vending machines, fridges, lifts, elevators",
    "vehicles and warehouse machinery: forklifts, pallet trucks, vans, tyres, car park barriers",
    "personal mobile phones, tablets, headsets and the apps on them",
    "business software and accounts: email clients, passwords, HR portal, ERP reports, spreadsheets, logins",
    "shredders and laminators",
    "laptop keyboards, mice, docking stations and personal computers",
    "办公家具：椅子、桌子、显示器支架、百叶窗",
    "厨房和楼宇设施：水龙头、咖啡机、自动售货机、电梯",
    "车辆和仓库机械：叉车、搬运车、货车、停车场道闸",
    "个人手机、平板电脑、耳机及其应用程序",
    "业务软件和账号：邮箱客户端、密码、人事系统、ERP 报表、Excel 表格、登录",
    "碎纸机和塑封机",
    "笔记本电脑键盘、鼠标、扩展坞和个人电脑",
)
#: The objects those exclusions name, as a requester would write them: a report whose subject (the
#: first object it names, before the device's own words) is one of these, and whose procedure never
#: mentions it, is out of scope ("the shredder next to the printer is grinding"). English terms match
#: whole words (a plural too); Chinese ones as written. ``FAULTDESK["OUT_OF_SCOPE_TERMS"]`` replaces them.
OUT_OF_SCOPE_TERMS = (
    "chair", "blinds", "curtain", "locker", "furniture", "monitor arm", "sofa",
    "tap", "sink", "kettle", "microwave", "fridge", "refrigerator", "dishwasher", "coffee machine", "toaster",
    "vending machine", "toilet", "lift", "elevator", "escalator", "light bulb",
    "forklift", "pallet truck", "van", "tyre", "tire", "car park barrier",
    "smartphone", "iphone", "android phone", "mobile", "tablet", "ipad", "headset", "earbuds",
    "outlook", "excel", "spreadsheet", "hr portal", "payroll", "expenses app", "driver", "template",
    "shredder", "laminator", "stapler", "projector screen",
    "椅子", "百叶窗", "窗帘", "储物柜", "家具", "水龙头", "水槽", "微波炉", "冰箱", "洗碗机", "咖啡机", "售货机",
    "马桶", "电梯", "扶梯", "灯泡", "叉车", "搬运车", "货车", "轮胎", "道闸", "手机", "平板", "耳机",
    "Outlook", "Excel", "报表", "人事系统", "企业微信", "驱动", "模板", "碎纸机", "塑封机", "订书机", "幕布",
)
_CODE_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]*[A-Za-z0-9]|\d")


def _topic_vectors(model: str) -> np.ndarray:
    topics = tuple(settings.FAULTDESK.get("OUT_OF_SCOPE_TOPICS") or OUT_OF_SCOPE_TOPICS)
    key = (model, topics)
    if key not in _TOPICS:
        _TOPICS[key] = np.asarray(embed_texts(list(topics), model=model) if topics else [], dtype=np.float64)
    return _TOPICS[key]


_TOPICS: dict = {}


def _generic_vectors(model: str) -> np.ndarray:
    if model not in _GENERIC:
        _GENERIC[model] = np.asarray(embed_texts(list(GENERIC_COMPLAINTS), model=model), dtype=np.float64)
    return _GENERIC[model]


_GENERIC: dict[str, np.ndarray] = {}


def _best_dot(vectors, q) -> float:
    """The largest dot product of query vector ``q`` with the rows of ``vectors`` (0.0 for none)."""
    if len(vectors) == 0:
        return 0.0
    return float(np.max(vectors @ np.asarray(q, dtype=np.float64)))


#: Words of alert codes that say how a thing is, not what it is (OUT in LBL-MEDIA-OUT-02, TEMP in
#: ENV-TEMP-HI-27): a report that uses them ("washed out", "temperature is fine") does not name the
#: alert's subject.
_STATE_WORDS = frozenset(
    "FAIL FAILED FAULT FLT ERR ERROR WARN MISMATCH TEMP LOW HIGH DENY FULL OFFLINE ONLINE LOST LOSS OUT OFF "
    "EXP EXPIRED WRONG VIOL TIMEOUT TIME STALE RATE OVERDUE MISSING HELD HANG DRIFT DEGRADED DEG SLOW SHORT "
    "STUCK STALL SOFT HARD SIZE REJECT RESET ACTIVE ABORT INVALID UNKNOWN UNREACH LEVEL MODE NONE LIMIT "
    "DOWN OPEN DUP DUAL REQ REF DEV THRESH RISE CHG NOT".split())


def names_alert_subject(report: str, alert: str | None) -> bool:
    """Whether ``report`` names a subject word of ``alert`` (a word of three letters or more of the
    code after its device prefix that is not a state word: FUSER in PRN-FUSER-50.2, BATT in
    UPS-BATT-017; not OUT or TEMP)."""
    if not alert or not report:
        return False
    words = [w for w in re.split(r"[^A-Z]+", alert.upper().split("-", 1)[-1])
             if len(w) >= 3 and w not in _STATE_WORDS]
    text = report.upper()
    return any(re.search(rf"(?<![A-Z]){w}", text) for w in words)


def report_codes(report: str, codes: set[str]) -> set[str]:
    """The alert codes of ``codes`` that ``report`` names: written whole ("PRN-FUSER-50.2", any
    case), or by their distinctive tail ("error 50.2", "13.B") when that tail is at least three
    characters with a digit and belongs to one code only."""
    text = report.upper()
    found = {c for c in codes if re.search(rf"(?<![A-Z0-9]){re.escape(c)}(?![A-Z0-9])", text)}
    tails: dict[str, set[str]] = {}
    for c in codes:
        tail = c.rsplit("-", 1)[-1]
        if len(tail) >= 3 and any(ch.isdigit() for ch in tail):
            tails.setdefault(tail, set()).add(c)
    for tok in _CODE_TOKEN.findall(text):
        if tok in tails and len(tails[tok]) == 1:
            found |= tails[tok]
    return found




def vagueness(q: list[float], *, model: str) -> float:
    """The similarity of query vector ``q`` (unit length, of ``model``) to the closest generic
    complaint: near 1 for "it is broken", low for a report that says what is wrong."""
    return _best_dot(_generic_vectors(model), q)


def topic_similarity(q: list[float], *, model: str) -> float:
    """The similarity of query vector ``q`` to the closest topic the desk does not handle (0.0
    when the setting lists none)."""
    return _best_dot(_topic_vectors(model), q)


def out_of_scope_terms() -> tuple[str, ...]:
    """The excluded objects in force (the setting, or :data:`OUT_OF_SCOPE_TERMS`)."""
    return tuple(settings.FAULTDESK.get("OUT_OF_SCOPE_TERMS") or OUT_OF_SCOPE_TERMS)


def _first_at(text: str, word: str) -> int | None:
    """Where ``word`` first occurs in lower-cased ``text``: as a whole word (or its plural) when it
    is written in Latin letters, anywhere when it is Chinese."""
    if is_chinese(word):
        i = text.find(word.lower())
        return None if i < 0 else i
    if word.lower() not in text:  # the usual case, without a regular expression
        return None
    m = re.search(rf"(?<![a-z0-9]){re.escape(word.lower())}(?:s|es)?(?![a-z0-9])", text)
    return m.start() if m else None


def excluded_subject(report: str, *, title: str, body: Callable[[], str], kind: str | None) -> str | None:
    """The excluded object (:data:`OUT_OF_SCOPE_TERMS`) ``report`` is about, or None.

    It is about one when it names the term before any word of the chosen procedure's ``title`` or
    the device's ``kind`` that is not itself a place ("the shredder next to the printer", 打印机旁边的
    碎纸机; not "the printer by the kettle"), the term is not only a place or a qualifier of the
    device (:func:`_landmark`), and the procedure's own text (``body()``, read only when a term is
    found) never mentions it: a procedure that speaks of the object covers it."""
    text = report.lower()
    found = sorted((at, t) for t in out_of_scope_terms() if (at := _first_at(text, t)) is not None)
    if not found:
        return None
    kind_words = [w for w in re.findall(r"[a-z0-9]{2,}", (kind or "").replace("_", " ").lower())]
    own = [w for w in re.findall(r"[a-z0-9]{3,}", title.lower()) if w not in _TITLE_STOPWORDS] + \
        [w for w in kind_words if len(w) >= 3] + [w for w in cjk_words(title) if len(w) >= 2]
    device_at = min((at for w in own for at in _all_at(text, w)
                     if not _is_place(text, at, w) and not _qualifies_term(text, at, w)), default=len(text))
    names_device = any(_first_at(text, w) is not None for w in kind_words)
    bodies = body().lower()
    for at, term in found:
        if at < device_at and _first_at(bodies, term) is None and not _landmark(text, at, term, own, names_device):
            return term
    return None


#: Words that make the object after them a place ("next to the lift") and, in Chinese, the
#: characters that make the object before them one (电梯口, 冰箱旁边).
_PLACE_BEFORE = re.compile(
    r"(?:next to|near|by|beside|behind|opposite|in front of|outside|past|at)\s+(?:the\s+|a\s+|an\s+)?$")


def _all_at(text: str, word: str):
    """Every position of ``word`` in ``text`` (:func:`_first_at`'s rules)."""
    if is_chinese(word):
        yield from (m.start() for m in re.finditer(re.escape(word.lower()), text))
    else:
        yield from (m.start() for m in re.finditer(rf"(?<![a-z0-9]){re.escape(word.lower())}(?:s|es)?(?![a-z0-9])",
                                                    text))


def _is_place(text: str, at: int, word: str) -> bool:
    """Whether ``word`` at ``at`` in ``text`` is where something else is ("next to the printer",
    打印机旁边) rather than what the report is about."""
    return bool(_PLACE_BEFORE.search(text[:at])) or \
        (is_chinese(word) and _PLACE_AFTER_ZH.match(text[at + len(word):]) is not None)


#: A Chinese place marker may follow the rest of a longer word (打印 + 机旁边).
_PLACE_AFTER_ZH = re.compile(r"^[\u4e00-\u9fff]?(?:口|旁|边|附近|那边|这边|门口|对面|前面|后面|楼下|楼上)")


def _qualifies_term(text: str, at: int, word: str) -> bool:
    """Whether the device's ``word`` at ``at`` only qualifies an excluded object right after it:
    "the printer driver", 打印机驱动, "the label template" (the object is the driver)."""
    rest = text[at + len(word):]
    if is_chinese(word):
        return any(rest.startswith(t.lower()) for t in out_of_scope_terms() if is_chinese(t))
    following = re.match(r"(?:s|es)?\s+([a-z0-9]+(?:\s+[a-z0-9]+)?)", rest)
    return bool(following) and any(_first_at(following.group(1), t) == 0 for t in out_of_scope_terms()
                                   if not is_chinese(t))


def _landmark(text: str, at: int, term: str, own: list[str], names_device: bool) -> bool:
    """Whether the excluded ``term`` at ``at`` in ``text`` only places or qualifies something else:
    a landmark ("walked past the lift", 电梯口), or — in a report that names the device itself — a
    modifier of one of the procedure's own words right after it ("the van keys" in a key cabinet
    report, "the lift's UPS"; not "the van battery is dead" to a UPS)."""
    if _is_place(text, at, term):
        return True
    following = re.match(r"(?:'s|’s|s|es)?\s+([a-z0-9]+)", text[at + len(term):])
    return names_device and bool(following) and \
        any(_first_at(following.group(1), w) == 0 for w in own if not is_chinese(w))


#: Words that ask for help without saying what is wrong.
_FILLER = frozenset("help please pls plz urgent asap fix fixed thanks thank you again now the and this that "
                    "its not any can someone anyone hello issue problem".split())
_FILLER_ZH = frozenset("帮忙 帮帮忙 救命 急 紧急 谢谢 请 处理 一下 问题 麻烦".split())


def has_content(report: str) -> bool:
    """Whether ``report`` says anything about a fault: a word of three letters or more that is not
    a plea ("help", "urgent"), a code-like token with a digit, or a Chinese word that is not one.
    "???", emoji and "help!!" say nothing."""
    if any(w.lower() not in _FILLER for w in re.findall(r"[A-Za-z]{3,}", report)):
        return True
    if re.search(r"[A-Za-z]*\d[A-Za-z0-9.\-]*", report) and re.search(r"\d", report):
        return True
    return any(w not in _FILLER_ZH for w in cjk_words(report))


_TITLE_STOPWORDS = frozenset("and the for with from out not off its on of to no".split())
