"""``{% load plan_labels %}``: a task's plan versions (``reducer/6``) in the reader's language.

The runtime records its plan sentences in English (apps/agent/plans.py, apps/agent/reads.py): a
barrier's ``why``, a refusal's ``reason``, what a re-validation ``checked``. Each filter here gives
an English reader exactly what was recorded, and another reader the same sentence rebuilt from its
known structure — the codes in it (steps, premise keys, chunk statuses) named in their language —
or, for a sentence of unknown shape, the recorded text unchanged (never dropped).

``{{ e|event_summary:task.state }}`` is the one line the event timeline shows under each plan
event's type (:func:`event_summary`)."""

from __future__ import annotations

import re

from django import template
from django.utils import translation
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from apps.accounts.models import Role
from apps.actions.models import ActionStatus
from apps.approvals.models import ApprovalStatus
from apps.tasks.models import STATUS_LABELS, reason_in_words

register = template.Library()

#: the steps of a plan (apps/tasks/reducer/v6.py ``STEPS``) as a reader calls them
STEP_LABELS = {"device": gettext_lazy("device read"), "ticket": gettext_lazy("open-ticket read"),
               "retrieval": gettext_lazy("retrieval"), "draft": gettext_lazy("draft"),
               "authorize": gettext_lazy("authorization"), "write": gettext_lazy("write")}
#: the premises of a plan version (``PREMISES``)
PREMISE_LABELS = {
    "request": gettext_lazy("report (digest)"), "scopes": gettext_lazy("requester's scopes"),
    "requester_role": gettext_lazy("requester's role"), "device_version": gettext_lazy("device version"),
    "device_profile": gettext_lazy("device profile (kind, alert)"),
    "policy_version": gettext_lazy("approval policy version"), "bundle": gettext_lazy("artifact bundle (digest)"),
    "approver_role": gettext_lazy("approver's role"), "ticket_epoch": gettext_lazy("open ticket's epoch"),
    "evidence": gettext_lazy("evidence carried"),
}
#: what became of a read activity (its status in ``state["activities"]``)
VERDICT_LABELS = {"dispatched": gettext_lazy("in flight"), "accepted": gettext_lazy("accepted"),
                  "revalidated": gettext_lazy("re-validated"), "refused": gettext_lazy("refused"),
                  "failed": gettext_lazy("failed"), "lapsed": gettext_lazy("lapsed"),
                  "unjoined": gettext_lazy("not joined")}
#: how a step continues across a barrier
CONTINUING_LABELS = {"joined": gettext_lazy("joined"), "in_flight": gettext_lazy("still in flight")}
#: a chunk's status in an ``evidence`` premise, for the task's requester when the plan was made
CHUNK_LABELS = {"current": gettext_lazy("current"), "superseded": gettext_lazy("superseded"),
                "retired": gettext_lazy("retired"), "unreadable": gettext_lazy("unreadable")}
#: the re-plans of earlier versions (``replan_due["event"]``)
REPLAN_EVENTS = {"input.provided": gettext_lazy("the requester answered"),
                 "approval.invalidated": gettext_lazy("the approval was invalidated"),
                 "dispatch.conflict": gettext_lazy("the ticket changed at dispatch"),
                 "intent.deferred": gettext_lazy("the write was deferred")}
#: the fixed sentences the runtime records (apps/agent/reads.py, apps/agent/reads.py's revalidate)
FIXED = {
    "first plan": gettext_lazy("first plan"),
    "the report was accepted": gettext_lazy("the report was accepted"),
    "the device's object version": gettext_lazy("the device's object version"),
    "every chunk retrieved is current and readable by the requester":
        gettext_lazy("every chunk retrieved is current and readable by the requester"),
    "a comment is conditional on the version read (If-Match): a moved ticket answers 412 and re-plans":
        gettext_lazy("a comment is conditional on the version read (If-Match): a moved ticket answers 412 and "
                     "re-plans"),
}


#: reasons the agent records in English as fixed sentences — why an approval was invalidated or
#: closed (apps/agent/authorization.py, apps/agent/intent.py, apps/approvals/services.py,
#: apps/approvals/projections.py, apps/outbox), why a plan was re-made — as a reader calls them
RECORDED_REASONS = {
    "another report's ticket for this device is being created: this report joins it":
        gettext_lazy("another report's ticket for this device is being created: this report joins it"),
    "the ticket changed since the approval": gettext_lazy("the ticket changed since the approval"),
    "the ticket changed since the approval (412)": gettext_lazy("the ticket changed since the approval (412)"),
    "expired": gettext_lazy("the approval expired undecided"),
    "approval expired": gettext_lazy("the approval expired"),
    "approval expired before a decision": gettext_lazy("the approval expired before a decision"),
    "requester's permissions changed: cited evidence no longer readable":
        gettext_lazy("the requester's permissions changed: cited evidence no longer readable"),
    "parameters changed since approval (digest mismatch)":
        gettext_lazy("the parameters changed since the approval (digest mismatch)"),
    "the approval's copy of what it approved was purged under the retention policy; its h(a) stays":
        gettext_lazy("the approval's copy of what it approved was purged under the retention policy; its h(a) "
                     "stays"),
    "the parameters shown for approval differ from the ones it binds (h(a) recomputed)":
        gettext_lazy("the parameters shown for approval differ from the ones it binds (h(a) recomputed)"),
    "approver no longer holds an approver role (or the account is deactivated)":
        gettext_lazy("the approver no longer holds an approver role (or the account is deactivated)"),
    "the parameters to commit differ from the approved ones (h(a) recomputed at the intent)":
        gettext_lazy("the parameters to commit differ from the approved ones (h(a) recomputed at the intent)"),
    "the task was cancelled": gettext_lazy("the task was cancelled"),
    "no readable evidence for this device and symptom":
        gettext_lazy("no readable evidence for this device and symptom"),
}
#: what the re-validated draft does instead of the held approval (apps/tasks/reducer/v6.py ``CLOSES_HELD``);
#: a closing reason is "<what moved> — <this>"
CLOSING = {
    "the proposal changed: asked again": gettext_lazy("the proposal changed: asked again"),
    "the re-validated draft asks the requester first": gettext_lazy("the re-validated draft asks the requester first"),
    "the re-validated draft needs no action": gettext_lazy("the re-validated draft needs no action"),
}


def _english() -> bool:
    return (translation.get_language() or "en").split("-")[0] == "en"


def _status(code: str) -> str:
    """A task, approval or action status code by its label (the first vocabulary's; the code when unknown)."""
    labels = {**dict(ActionStatus.choices), **dict(ApprovalStatus.choices), **STATUS_LABELS}
    return str(labels.get(code, code))


def _listed(items) -> str:
    """``items`` as a reader lists them (``a, b``; ``a、b`` in Chinese)."""
    return ("、" if (translation.get_language() or "").startswith("zh") else ", ").join(str(i) for i in items)


def _premises(keys: str) -> str:
    return _listed(PREMISE_LABELS.get(k.strip(), k.strip()) for k in keys.split(","))


def _chunks(text: str) -> str | None:
    """``chunk 2 superseded, chunk 3 retired`` rebuilt, or None when it is not that shape."""
    parts = [re.fullmatch(r"chunk (\S+) (\w+)", p.strip()) for p in text.split(",")]
    if not all(parts):
        return None
    return _listed(_("chunk %(chunk)s %(status)s") % {"chunk": m.group(1), "status": CHUNK_LABELS.get(m.group(2),
                                                                                                        m.group(2))}
                   for m in parts)


def _reason(text: str) -> str:
    """A recorded reason of one of the agent's known shapes, else with its leading termination code
    named (:func:`reason_in_words`)."""
    return _sentence(text) or reason_in_words(text)


def _roles(text: str) -> str:
    """``approver or admin`` (roles as a policy error names them) in the reader's words."""
    names = dict(Role.choices)
    return str(_(" or ")).join(str(names.get(r.strip(), r.strip())) for r in text.split(" or "))


def _sentence(text: str) -> str | None:
    """A sentence the runtime records — a plan's reason, a barrier's ``why``, why an approval was
    invalidated or closed — rebuilt in the reader's language, or None when it is of no known shape."""
    if text in FIXED:
        return str(FIXED[text])
    if text in RECORDED_REASONS:
        return str(RECORDED_REASONS[text])
    if text in CLOSING:
        return str(CLOSING[text])
    if m := re.fullmatch(r"(.+) — (.+)", text, re.S):
        if m.group(2) in CLOSING:
            return _("%(why)s — %(instead)s") % {"why": _sentence(m.group(1)) or m.group(1),
                                                 "instead": CLOSING[m.group(2)]}
    if m := re.fullmatch(r"the (\w+) read found premises moved on: (.+)", text):
        return _("the %(step)s found premises moved on: %(premises)s") % {
            "step": STEP_LABELS.get(m.group(1), m.group(1)), "premises": _premises(m.group(2))}
    if m := re.fullmatch(r"premises changed while the task waited for its approval: (.+)", text):
        return _("premises changed while the task waited for its approval: %(premises)s") % {
            "premises": _premises(m.group(1))}
    if (m := re.fullmatch(r"evidence changed while the task waited: (.+)", text)) and (chunks := _chunks(m.group(1))):
        return _("evidence changed while the task waited: %(chunks)s") % {"chunks": chunks}
    if m := re.fullmatch(r"([a-z]+\.[a-z]+): (.*)", text, re.S):
        if m.group(1) in REPLAN_EVENTS:
            event, reason = REPLAN_EVENTS[m.group(1)], m.group(2)
            return str(event) if reason == m.group(1) else _("%(event)s: %(reason)s") % {
                "event": event, "reason": _reason(reason)}
    if text in REPLAN_EVENTS:
        return str(REPLAN_EVENTS[text])
    if m := re.fullmatch(r"approval is ([A-Z_]+)", text):
        return _("the approval is %(status)s") % {"status": _status(m.group(1))}
    if m := re.fullmatch(r"device version changed since approval \((\d+) → (\d+)\)", text):
        return _("the device version changed since the approval (%(then)s → %(now)s)") % {
            "then": m.group(1), "now": m.group(2)}
    if m := re.fullmatch(r"policy changed since approval \(v(\d+) → v(\d+)\): only (.+) may approve (\S+) now", text):
        return _("the approval policy changed since the approval (v%(then)s → v%(now)s): only %(roles)s may "
                 "approve %(tool)s now") % {"then": m.group(1), "now": m.group(2), "roles": _roles(m.group(3)),
                                            "tool": m.group(4)}
    if m := re.fullmatch(r"the ticket system changed since approval \(now (.+)\)", text):
        return _("the ticket system changed since the approval (now %(system)s)") % {"system": _(m.group(1))}
    if m := re.fullmatch(r"the task ended \(([A-Z_]+): (.*)\)", text, re.S):
        return _("the task ended (%(status)s: %(reason)s)") % {"status": _status(m.group(1)),
                                                              "reason": reason_in_words(m.group(2))}
    if m := re.fullmatch(r"carried over from approval (\S+): the same low-risk (\S+), only the ticket version moved "
                         r"\((\d+) → (\d+)\)", text):
        return _("carried over from approval %(approval)s: the same low-risk %(tool)s, only the ticket version "
                 "moved (%(then)s → %(now)s)") % {"approval": m.group(1), "tool": m.group(2), "then": m.group(3),
                                                  "now": m.group(4)}
    if m := re.fullmatch(r"(ticket\.\w+) ([A-Z_]+) for device (\S+)", text):
        return _("%(tool)s %(status)s for device %(device)s") % {
            "tool": m.group(1), "status": _status(m.group(2)), "device": m.group(3)}
    return None


def recorded_sentence(text: object) -> object:
    """A recorded sentence of a known shape (:func:`_sentence`) for the reader; any other text (a
    person's words) exactly as recorded."""
    if not isinstance(text, str) or _english():
        return text
    return _sentence(text) or text


@register.filter
def plan_sentence(text: object) -> object:
    """A plan version's recorded ``reason`` or its barrier's ``why`` for the reader."""
    if not isinstance(text, str) or _english():
        return text
    return _reason(text)


@register.filter
def refusal_reason(text: object) -> object:
    """A ``result.refused`` reason for the reader."""
    if not isinstance(text, str) or _english():
        return text
    if m := re.fullmatch(r"premises it depends on changed: (.+)", text):
        return _("premises it depends on changed: %(premises)s") % {"premises": _premises(m.group(1))}
    if m := re.fullmatch(r"re-validation failed after (.+?) changed: (.*)", text, re.S):
        return _("re-validation failed after %(premises)s changed: %(why)s") % {
            "premises": _premises(m.group(1)), "why": check_why(m.group(2))}
    return text


@register.filter
def check_what(text: object) -> object:
    """What a re-validation ``checked``, for the reader."""
    return FIXED.get(text, text) if isinstance(text, str) and not _english() else text


@register.filter
def check_why(text: object) -> object:
    """Why a re-validation failed (its ``why``), for the reader."""
    if not isinstance(text, str) or _english() or not text:
        return text
    if m := re.fullmatch(r"the device is at v(\S+) now", text):
        return _("the device is at v%(version)s now") % {"version": m.group(1)}
    return _chunks(text) or text


@register.filter
def settled_reason(text: object) -> object:
    """The reason recorded when only a read's cost was (it lapsed, or reported when nothing waited)."""
    if not isinstance(text, str) or _english():
        return text
    if m := re.fullmatch(r"the (\w+) read did not report by its deadline: charged at its reservation, read again",
                         text):
        return _("the %(step)s did not report by its deadline: charged at its reservation, read again") % {
            "step": STEP_LABELS.get(m.group(1), m.group(1))}
    if m := re.fullmatch(r"the (\w+) read reported when nothing waited for it", text):
        return _("the %(step)s reported when nothing waited for it: only its cost was recorded") % {
            "step": STEP_LABELS.get(m.group(1), m.group(1))}
    return text


@register.filter
def read_error(text: object) -> object:
    """A ``read.failed`` error for the reader (the system's own message kept as it came)."""
    if not isinstance(text, str) or _english():
        return text
    if m := re.fullmatch(r"the ticket system cannot be read now: (.*)", text, re.S):
        return _("the ticket system cannot be read now: %(error)s") % {"error": m.group(1)}
    return text


def _label(table: dict, code: object) -> object:
    """``code``'s name in ``table`` (a label, lazily translated), the code itself when unknown or
    not a string."""
    return table.get(code, code) if isinstance(code, str) else code


@register.filter
def step_label(code: object) -> object:
    return _label(STEP_LABELS, code)


@register.filter
def premise_label(code: object) -> object:
    return _label(PREMISE_LABELS, code)


@register.filter
def premises_label(codes: object) -> object:
    """A list of premise keys as a reader lists their names."""
    return _listed(PREMISE_LABELS.get(c, c) for c in codes) if isinstance(codes, list | tuple) else codes


@register.filter
def verdict_label(code: object) -> object:
    return _label(VERDICT_LABELS, code)


@register.filter
def continuing_label(code: object) -> object:
    return _label(CONTINUING_LABELS, code)


@register.filter
def chunk_label(code: object) -> object:
    return _label(CHUNK_LABELS, code)


@register.filter
def role_label(code: object) -> object:
    """A role recorded in a premise (``revoked``: the approver holds none now)."""
    if code == "revoked":
        return _("revoked")
    return dict(Role.choices).get(code, code) if isinstance(code, str) else code


@register.filter
def steps_list(codes: object) -> str:
    """Steps (a barrier's ``cancelled``) as a reader lists them; "" for none."""
    return _listed(STEP_LABELS.get(s, s) for s in codes) if isinstance(codes, list | tuple) else ""


@register.filter
def continuing_list(continuing: object) -> str:
    """A barrier's ``continuing`` (``{step: "joined" | "in_flight"}``) as a reader lists it; "" for none."""
    if not isinstance(continuing, dict):
        return ""
    return _listed(_("%(step)s (%(how)s)") % {"step": STEP_LABELS.get(s, s), "how": CONTINUING_LABELS.get(h, h)}
                   for s, h in continuing.items())


@register.filter
def event_summary(event: object, state: object = None) -> str:
    """One line saying what a plan event of ``reducer/6`` did — ``plan.activated``, a read's
    ``budget.reserved``, ``device.read`` / ``ticket.read`` / ``evidence.retrieved`` with their
    verdict, ``result.refused``, ``read.failed``, ``approval.revalidated``, a read's
    ``budget.settled`` — in the reader's language; "" for any other event. ``state``: the task's
    state, which names the step of a refused or failed activity."""
    etype, p = getattr(event, "type", ""), getattr(event, "payload", None)
    if not isinstance(p, dict):
        return ""
    activities = (state.get("activities") or {}) if isinstance(state, dict) else {}
    act = activities.get(p.get("activity_id") or p.get("reservation_id")) or {}
    step = STEP_LABELS.get(act.get("step") or p.get("step") or "", act.get("step") or p.get("step") or "")
    version = p.get("plan_version") or act.get("plan_version")
    if etype == "plan.activated":
        b = p.get("barrier")
        if not b:
            return _("plan v%(version)s: %(reason)s") % {"version": p.get("version"),
                                                          "reason": plan_sentence(p.get("reason") or "")}
        continuing = continuing_list(b.get("continuing")) or "—"
        return _("plan v%(version)s replaces v%(previous)s: %(why)s · continuing: %(continuing)s · cancelled: "
                 "%(cancelled)s") % {"version": p.get("version"), "previous": b.get("from_version"),
                                     "why": plan_sentence(b.get("why") or ""), "continuing": continuing,
                                     "cancelled": steps_list(b.get("cancelled")) or "—"}
    if etype == "budget.reserved" and p.get("step"):
        return _("dispatches the %(step)s under plan v%(version)s") % {"step": step, "version": version}
    if etype in ("device.read", "ticket.read", "evidence.retrieved") and p.get("verdict"):
        if p["verdict"] == "revalidated":
            return _("%(step)s of plan v%(version)s: re-validated (checked %(checked)s)") % {
                "step": step, "version": version, "checked": check_what((p.get("revalidation") or {}).get("checked"))}
        return _("%(step)s of plan v%(version)s: %(verdict)s") % {
            "step": step, "version": version, "verdict": VERDICT_LABELS.get(p["verdict"], p["verdict"])}
    if etype == "result.refused":
        return _("%(step)s of plan v%(version)s refused: %(reason)s") % {
            "step": step, "version": version, "reason": refusal_reason(p.get("reason") or "")}
    if etype == "read.failed":
        return _("%(step)s of plan v%(version)s failed: %(error)s") % {
            "step": step, "version": version, "error": read_error(p.get("error") or "")}
    if etype == "approval.revalidated":
        return _("the held approval stands: the re-validated draft proposes the same action")
    if etype == "budget.settled" and act and p.get("reason"):
        return str(settled_reason(p["reason"]))
    return ""
