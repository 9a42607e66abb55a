"""The context read (spec §16.1 step 1; DESIGN.md §9): retrieval, the device read and the device's open
ticket, each recorded as an event before anything uses it; instructions found in the report, the
answers or the device's text fields are flagged and change nothing else."""

from __future__ import annotations

import logging

from django.conf import settings
from django.utils import timezone

from apps.accounts.principal import principal_current
from apps.agent.common import (
    actor_of,
    deadline_reason,
    fail,
    has_ledger,
    plans_comments,
)
from apps.agent.intent import joined_ticket_pending
from apps.agent.plans import report_text
from apps.core import tool_errors as errors
from apps.devices.selectors import device_read
from apps.evidence.guard import injection_flags, refs_flags
from apps.evidence.relevance import evidence_select
from apps.tasks.budget import activity_timeout, budget_reserve, budget_settle
from apps.tasks.leases import Lease
from apps.tasks.models import Task
from apps.tasks.runs import checkpoint
from apps.tasks.store import task_append_event
from apps.tasks.usage import BudgetExceeded
from apps.tickets.selectors import open_ticket_read

log = logging.getLogger(__name__)


def _principal_scopes(task: Task) -> list[str]:

    p = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    return list(p.scopes) if p else []


def _attachments(task: Task) -> list[dict]:
    return ((task.state or {}).get("request") or {}).get("attachments") or []


#: device fields a person or a device's own feed can write (names, tags, codes, messages): checked
#: for instructions like a report — each may reach the prompt or the rules' ticket title
_DEVICE_TEXT_FIELDS = ("name", "asset_tag", "kind", "alert_code", "alert_message", "site", "model", "state",
                       "criticality")


def input_flags(*, report: str, answers: list[str], reading: dict | None,
                attachments: list[dict] = ()) -> list[dict]:
    """``[{"source", "flags"}]`` for the report, the requester's answers, the text of the logs
    attached to it (``attachments``: ``[{"name", "text"?}]``) and the device's text fields
    (``reading``, a device reading or None) that read like instructions to an agent (DESIGN.md §9):
    recorded with the retrieval, shown on the trace and the approval queue, and changing nothing
    else."""
    out = []
    for i, text in enumerate([report, *answers]):
        if flags := injection_flags(text):
            out.append({"source": "report" if i == 0 else f"answer {i}", "flags": flags})
    for a in attachments:
        if flags := injection_flags(str(a.get("name") or "")):
            out.append({"source": "attachment name", "flags": flags})
        if flags := injection_flags(a.get("text") or ""):
            out.append({"source": f"attachment {a.get('name')}", "flags": flags})
    for name in _DEVICE_TEXT_FIELDS:
        if flags := injection_flags(str((reading or {}).get(name) or "")):
            out.append({"source": f"device field {name}", "flags": flags})
    return out


def context_step(task: Task, lease: Lease) -> bool:
    """RETRIEVING (the ``tools`` pool): retrieval, the device read and the device's open ticket, each
    recorded as an event (``evidence.retrieved``, ``ticket.read`` from ``reducer/2`` on,
    ``device.read``). Under ``reducer/3`` the reads are one activity: admitted by a reservation of
    their tool calls, given a deadline-bounded timeout, and settled at the calls made.

    The reads run outside any transaction (:func:`~apps.tasks.runs.checkpoint`), after the
    reservation is committed; their results are recorded together afterwards. Returns True when
    the task moved on (the next step may follow), False when it stopped: failed, or the ticket
    system could not be read now (what was read is recorded; the sweeper brings the task back)."""
    gen, actor = lease.generation, actor_of(lease)
    if joined_ticket_pending(task):
        return False  # one ticket per fault: another report's ticket for this device is still being created
    reservation, timeout = None, None
    if has_ledger(task):
        calls = 2 + (task.state["evidence"] is None)  # device read, ticket read, retrieval
        timeout = activity_timeout(task, wanted=settings.FAULTDESK["REFSERVICE_TIMEOUT_SECONDS"])
        if timeout is None:
            fail(task, lease, deadline_reason(task))
            return False
        try:
            task, reservation = budget_reserve(task_id=task.pk, activity="context_read",
                                               amounts={"tool_calls": calls}, actor=actor,
                                               lease_generation=gen, timeout_s=timeout, task=task)
        except BudgetExceeded as exc:
            fail(task, lease, exc.reason)
            return False
    reads = _Reads()
    try:
        with checkpoint():
            _read(task, reads, timeout)
        if reads.selection is not None:
            task = task_append_event(task=task, event_type="evidence.retrieved", actor=actor, lease_generation=gen,
                                     payload=reads.evidence_payload(task))
        if reads.ticket_error is not None:
            log.info("context_read %s: the ticket system cannot be read now (%s); retried later",
                     task.pk, reads.ticket_error)
            return False
        # A device gone from the tenant: settle the reads made (below), then fail the task.
        if reads.device is not None:
            if reads.ticket_read:
                task = task_append_event(task=task, event_type="ticket.read", actor=actor, lease_generation=gen,
                                         payload={"ticket": reads.ticket, "read_at": reads.ticket_at})
            task = task_append_event(task=task, event_type="device.read", actor=actor, lease_generation=gen,
                                     payload={"reading": reads.device, "read_at": reads.device_at})
    finally:
        if reservation is not None:
            task = budget_settle(task_id=task.pk, reservation_id=reservation.id, used={"tool_calls": reads.made},
                                 actor=actor, lease_generation=gen)
    if reads.device is None:
        fail(task, lease, "device no longer exists in the tenant")
        return False
    return True


class _Reads:
    """What :func:`_read` found, outside any transaction: the device reading, the evidence
    selection, the open ticket (or the error reading it), when each was read, and how many tool
    calls were made."""

    def __init__(self) -> None:
        self.made = 0
        self.device = self.device_at = None
        self.selection = self.retrieved_at = None
        self.ticket = self.ticket_at = self.ticket_error = None
        self.ticket_read = False

    def evidence_payload(self, task: Task) -> dict:
        ref_dicts, chosen = self.selection.recorded()
        payload = {"query": report_text(task), "refs": ref_dicts, "selection": chosen,
                   "retrieved_at": self.retrieved_at}
        flagged = refs_flags(ref_dicts) + input_flags(report=task.symptom, answers=task.state.get("answers", []),
                                                      reading=self.device, attachments=_attachments(task))
        if flagged:
            payload["injection_flags"] = flagged  # shown on the trace and queue; nothing else changes
            chosen["injection_flags"] = flagged
        return payload


def _read(task: Task, reads: _Reads, timeout: float | None) -> None:
    """The reads of :func:`context_step`, in its order: the device, the evidence (unless already
    retrieved), and — for a device that exists, under a plan that may comment — its open ticket.
    Fills ``reads``; a ticket system that cannot be read is kept as ``reads.ticket_error``."""
    reads.made += 1
    reads.device = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
    reads.device_at = timezone.now().isoformat()
    if task.state["evidence"] is None:
        reads.made += 1
        reads.selection = evidence_select(
            tenant_id=task.tenant_id,
            scopes=_principal_scopes(task),
            report=report_text(task),
            device=reads.device,
            k=settings.FAULTDESK["RETRIEVAL_TOP_K"],
            model=task.artifact_bundle.get("embedding_model"),
        )
        reads.retrieved_at = timezone.now().isoformat()
    if reads.device is not None and plans_comments(task):
        # The device's open ticket, read at its ticket system: the plan may comment on it.
        reads.made += 1
        try:
            reads.ticket = open_ticket_read(tenant_id=task.tenant_id, device_id=task.device_id,
                                            connector=task.tenant.ticket_system, timeout=timeout)
            reads.ticket_read = True
        except errors.ToolError as exc:
            reads.ticket_error = exc
        reads.ticket_at = timezone.now().isoformat()
