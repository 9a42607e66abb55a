"""Tenant-scoped reads of approvals: the list and the approver's queue page."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

from django.core.paginator import Page, Paginator
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from apps.accounts.principal import Principal, principals_current
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.evidence.selectors import chunks_now
from apps.tickets.models import TicketMirror


def approval_list(*, principal: Principal, status: str | None = None) -> QuerySet[ApprovalRequest]:
    """Approvals of the principal's tenant (approvers and admins only; others get none)."""
    if not principal.is_approver:
        return ApprovalRequest.objects.none()
    qs = ApprovalRequest.objects.visible_to(principal).select_related(
        "task", "task__device", "requested_by", "decided_by"
    )
    if status:
        qs = qs.filter(status=status)
    return qs.order_by("-created_at")


def approval_get(*, principal: Principal, approval_id) -> ApprovalRequest | None:
    return approval_list(principal=principal).filter(pk=approval_id).first()


QUEUE_PAGE_SIZE = 20
#: a pending approval whose request must be answered within this long is marked "due soon"
DUE_SOON = timedelta(hours=1)
#: Queue filters: "EXPIRED" also covers approvals still PENDING whose expiry has passed (the agent
#: invalidates them at its next step; the queue shows them as expired at once).
QUEUE_STATUSES = ("PENDING", "APPROVED", "REJECTED", "INVALIDATED", "EXPIRED", "ALL")


#: what approving does when evidence an approval cites moved while it waited (EvidenceMoved.if_approved)
ASKS_AGAIN = "asks_again"  # the action cannot come out the same: the agent re-drafts and asks again
REVALIDATES = "revalidates"  # the agent re-drafts first; the action is sent only if it comes out the same
SENT_AS_ASKED = "sent_as_asked"  # a task on a reducer without plan versions: the action goes as it was asked
IF_APPROVED = (ASKS_AGAIN, REVALIDATES, SENT_AS_ASKED)
#: how a cited chunk can have moved (EvidenceMoved.chunks' values)
MOVED_STATUSES = ("superseded", "retired", "unreadable")


@dataclass(frozen=True)
class EvidenceMoved:
    """The chunks a pending approval cites that are no longer what it was asked on —
    ``{chunk_id: "superseded" | "retired" | "unreadable"}`` (unreadable: deleted, or outside the
    requester's scopes now) — and ``if_approved``, one of :data:`IF_APPROVED`: what approving does,
    as the task's resume decides it (long-task-runtime.md, resume; apps.agent.authorization)."""

    chunks: dict[str, str]
    if_approved: str


@dataclass
class QueueRow:
    """One approval on the queue page with what the approver needs beside it: whether it can
    still be decided, the object's version now (``None`` when unknown), and the parameters that
    changed since the task's previous proposal (``[(name, before, after)]``, empty for the first)."""

    approval: ApprovalRequest
    decidable: bool
    version_now: int | None
    changes: list[tuple[str, str, str]] = field(default_factory=list)
    previous: ApprovalRequest | None = None
    #: the request's respond-by date has passed (``overdue``) or comes within :data:`DUE_SOON`
    overdue: bool = False
    due_soon: bool = False
    #: the approval is the one its task waits on now (pending, decidable, the task's current approval,
    #: no newer one asked): its evidence heading is the task's selection; any other approval's heading
    #: is built from what it recorded (its ``evidence``), never from what the task found later
    current: bool = False
    #: the task's state while it still speaks for this approval (the task's current approval, no newer
    #: one asked, no re-validation under way), else None: the draft's screening and the priority the
    #: rules overrode are read from it
    state: dict | None = None
    #: the cited evidence that moved since the approval was asked, and what approving does then
    #: (:func:`evidence_moved`); None when nothing moved or the approval cannot be decided
    evidence_moved: EvidenceMoved | None = None


def _state_approval_ids(state: dict) -> set[str]:
    """The ids of the approvals ``state`` holds now: the task's and its compensation's."""
    ids = set()
    for holder in (state, state.get("compensation") or {}):
        approval = holder.get("approval") if isinstance(holder, dict) else None
        if isinstance(approval, dict) and approval.get("id"):
            ids.add(str(approval["id"]))
    return ids


def _speaking_for(approval: ApprovalRequest, *, newer: bool, decidable: bool) -> tuple[bool, dict | None]:
    """``(current, state)`` of a :class:`QueueRow` (see its fields). ``newer``: the task asked
    another approval after this one."""
    state = approval.task.state if isinstance(approval.task.state, dict) else {}
    own = not newer and str(approval.pk) in _state_approval_ids(state) and not state.get("revalidating")
    return own and decidable, state if own else None


def approval_queue(*, principal: Principal, status: str = "PENDING", tool: str = "", device: str = "",
                   page: int | str = 1, now=None) -> tuple[Page, list[QueueRow]]:
    """One page (:data:`QUEUE_PAGE_SIZE` rows) of the tenant's approvals for the queue page — the
    pending ones soonest due first (their request's respond-by date: what would breach the SLA
    first is decided first), every other view newest first — filtered by ``status`` (one of
    :data:`QUEUE_STATUSES`), ``tool`` and ``device`` (asset tag substring). A constant number of
    queries whatever the queue's size: the page, one query for the other proposals of its tasks
    (the previous one, and whether a newer one was asked) and one for the ticket mirrors it
    targets. Unknown filter values are treated as no filter; an out-of-range page is the last page."""
    now = now or timezone.now()
    qs = approval_list(principal=principal)
    if status == "EXPIRED":
        qs = qs.filter(Q(status=ApprovalStatus.EXPIRED) | Q(status=ApprovalStatus.PENDING, expires_at__lte=now))
    elif status == "PENDING":
        qs = qs.filter(status=ApprovalStatus.PENDING, expires_at__gt=now).order_by(
            F("respond_by").asc(nulls_last=True), "-created_at")
    elif status in ApprovalStatus.values:
        qs = qs.filter(status=status)
    if tool:
        qs = qs.filter(tool=tool)
    if device:
        qs = qs.filter(task__device__asset_tag__icontains=device)
    page_obj = Paginator(qs, QUEUE_PAGE_SIZE).get_page(page)
    approvals = list(page_obj.object_list)
    earlier = (ApprovalRequest.objects.visible_to(principal)
               .filter(task_id__in={a.task_id for a in approvals})
               .only("id", "task_id", "params", "created_at", "status", "reason", "closed_reason", "object_version")
               .order_by("task_id", "created_at"))
    by_task: dict = {}
    for e in earlier:
        by_task.setdefault(e.task_id, []).append(e)
    tickets = {m.external_id: m.external_version for m in TicketMirror.objects.visible_to(principal).filter(
        external_id__in=[a.object_id for a in approvals if a.object_type == "ticket"])}
    moved = evidence_moved(principal=principal, approvals=approvals, now=now)
    rows = []
    for a in approvals:
        before = [e for e in by_task.get(a.task_id, []) if e.created_at < a.created_at]
        previous = before[-1] if before else None
        newer = any(e.created_at > a.created_at for e in by_task.get(a.task_id, []))
        decidable = a.status == ApprovalStatus.PENDING and a.expires_at > now
        current, state = _speaking_for(a, newer=newer, decidable=decidable)
        version_now = a.task.device.version if a.object_type == "device" else tickets.get(a.object_id)
        due = a.respond_by
        rows.append(QueueRow(approval=a, decidable=decidable, current=current, state=state,
                             version_now=version_now, previous=previous,
                             changes=params_changes(previous.params, a.params) if previous else [],
                             overdue=due is not None and due <= now,
                             due_soon=due is not None and now < due <= now + DUE_SOON,
                             evidence_moved=moved.get(a.pk)))
    return page_obj, rows


def _cited_chunk_ids(approval: ApprovalRequest) -> list[str]:
    refs = approval.evidence if isinstance(approval.evidence, list) else []
    ids = (str(r.get("chunk_id", "")) for r in refs if isinstance(r, dict))
    return [c for c in ids if c.isascii() and c.isdecimal()]


def _asked_by_the_task(approval: ApprovalRequest) -> bool:
    """The approval is the one the task's own action waits on (not a compensation's: closing a
    ticket does not rest on the evidence, and its resume does not re-read it)."""
    state = approval.task.state if isinstance(approval.task.state, dict) else {}
    own = state.get("approval")
    return isinstance(own, dict) and str(own.get("id")) == str(approval.pk)


def evidence_moved(*, principal: Principal, approvals: list[ApprovalRequest], now=None) -> dict:
    """``{approval_id: EvidenceMoved}`` for those of ``approvals`` that are decidable (pending, not
    expired at ``now``), asked by their task's own action, and whose cited chunks moved since:
    superseded, retired, or no longer readable by the requester (their scopes now). What approving
    does follows the resume's order: a cited chunk the requester may no longer read invalidates the
    approval and the task asks again; on a task that keeps plan versions, a moved chunk the action
    itself names (``params["evidence"]``) cannot be cited again, so the re-draft differs and the
    task asks again, and other moved evidence is re-validated (sent only if the action comes out the
    same); a task without plan versions sends the action as it was asked. Two queries (the chunks,
    the requesters' memberships), none when no approval cites anything; an approval whose requester
    is gone is left out (its resume ends the task instead)."""
    now = now or timezone.now()
    asked = {a.pk: (a, _cited_chunk_ids(a)) for a in approvals
             if a.status == ApprovalStatus.PENDING and a.expires_at > now and _asked_by_the_task(a)}
    ids = {c for _, chunk_ids in asked.values() for c in chunk_ids}
    if not ids:
        return {}
    chunks = chunks_now(tenant_id=principal.tenant_id, chunk_ids=ids)
    requesters = principals_current(user_ids={a.task.requester_id for a, _ in asked.values()},
                                    tenant_id=principal.tenant_id)
    out = {}
    for pk, (a, chunk_ids) in asked.items():
        requester = requesters.get(a.task.requester_id)
        if requester is None:
            continue
        moved = {c: chunks[c].status_for(requester.scopes) for c in chunk_ids}
        moved = {c: status for c, status in moved.items() if status != "current"}
        if not moved:
            continue
        named = {str(c) for c in (a.params.get("evidence") or [])} if isinstance(a.params, dict) else set()
        keeps_plans = bool(a.task.state.get("plans"))
        if "unreadable" in moved.values() or (keeps_plans and named & set(moved)):
            if_approved = ASKS_AGAIN
        else:
            if_approved = REVALIDATES if keeps_plans else SENT_AS_ASKED
        out[pk] = EvidenceMoved(chunks=moved, if_approved=if_approved)
    return out


def params_changes(before: dict, after: dict, *, limit: int = 160) -> list[tuple[str, str, str]]:
    """``[(name, before, after)]`` for every top-level parameter that differs (``"—"`` for a
    parameter one side does not have). Long values are cut to a window of ``limit`` characters
    around the first difference, so the change itself is what shows."""
    def text(value) -> str:
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)

    def window(value: str, start: int) -> str:
        if len(value) <= limit:
            return value
        lo = max(0, min(start - limit // 3, len(value) - limit))
        return ("…" if lo else "") + value[lo:lo + limit] + ("…" if lo + limit < len(value) else "")

    out = []
    for name in sorted(set(before) | set(after)):
        if before.get(name) == after.get(name):
            continue
        old = text(before[name]) if name in before else "—"
        new = text(after[name]) if name in after else "—"
        first = next((i for i, (x, y) in enumerate(zip(old, new, strict=False)) if x != y), min(len(old), len(new)))
        out.append((name, window(old, first), window(new, first)))
    return out


def approval_queue_row(*, principal: Principal, approval: ApprovalRequest, now=None) -> QueueRow:
    """The :class:`QueueRow` of one approval (after a decision, to redraw its row)."""
    now = now or timezone.now()
    siblings = ApprovalRequest.objects.visible_to(principal).filter(task_id=approval.task_id)
    previous = siblings.filter(created_at__lt=approval.created_at).order_by("-created_at").first()
    newer = siblings.filter(created_at__gt=approval.created_at).exists()
    if approval.object_type == "device":
        version_now = approval.task.device.version
    else:
        mirror = TicketMirror.objects.visible_to(principal).filter(external_id=approval.object_id).first()
        version_now = mirror.external_version if mirror else None
    decidable = approval.status == ApprovalStatus.PENDING and approval.expires_at > now
    current, state = _speaking_for(approval, newer=newer, decidable=decidable)
    due = approval.respond_by
    return QueueRow(approval=approval, decidable=decidable, current=current, state=state,
                    version_now=version_now, previous=previous,
                    changes=params_changes(previous.params, approval.params) if previous else [],
                    overdue=due is not None and due <= now,
                    due_soon=due is not None and now < due <= now + DUE_SOON,
                    evidence_moved=evidence_moved(principal=principal, approvals=[approval], now=now).get(approval.pk))
