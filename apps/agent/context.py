"""The context read (spec §16.1 step 1; DESIGN.md §9): retrieval, the device read and the device's open
ticket, each recorded as an event before anything uses it; instructions found in the report, the
answers or the device's text fields are flagged and change nothing else."""

from __future__ import annotations

import logging
import uuid

from django.conf import settings
from django.utils import timezone

from apps.accounts.principal import principal_current
from apps.agent.common import (
    actor_of,
    deadline_reason,
    fail,
    has_ledger,
    plans_comments,
    release_stale,
)
from apps.core import tool_errors as errors
from apps.core.queue import AGENT_STEP, enqueue_on_commit
from apps.devices.selectors import device_read
from apps.evidence.guard import injection_flags, refs_flags
from apps.evidence.relevance import evidence_select
from apps.tasks import reducer
from apps.tasks.budget import activity_timeout, budget_reserve, budget_settle
from apps.tasks.leases import task_claim, task_release
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, task_append_event
from apps.tasks.usage import BudgetExceeded
from apps.tickets.selectors import open_ticket_read
from config.logs import bind

log = logging.getLogger(__name__)


def _principal_scopes(task: Task) -> list[str]:

    p = principal_current(user_id=task.requester_id, tenant_id=task.tenant_id)
    return list(p.scopes) if p else []


def _report_text(task: Task) -> str:
    """What the requester reported: the symptom and the answers given since (the device's alert is
    matched separately, so it cannot drown the report; apps.evidence.relevance)."""
    return " ".join(p for p in [task.symptom, *task.state.get("answers", [])] if p)


#: device fields a person can type into (names, messages): checked for instructions like a report
_DEVICE_TEXT_FIELDS = ("name", "alert_message", "site", "model")


def _input_flags(task: Task, reading: dict | None) -> list[dict]:
    """``[{"source", "flags"}]`` for the report, the requester's answers and the device's text
    fields that read like instructions to an agent (DESIGN.md §9): recorded with the retrieval,
    shown on the trace and the approval queue, and changing nothing else."""
    out = []
    for i, text in enumerate([task.symptom, *task.state.get("answers", [])]):
        if flags := injection_flags(text):
            out.append({"source": "report" if i == 0 else f"answer {i}", "flags": flags})
    for name in _DEVICE_TEXT_FIELDS:
        if flags := injection_flags(str((reading or {}).get(name) or "")):
            out.append({"source": f"device field {name}", "flags": flags})
    return out


def context_read(*, task_id: uuid.UUID) -> None:
    """The ``tools`` step: retrieval and the device read, each recorded as an event
    (``evidence.retrieved``, ``device.read``; ``ticket.read`` from ``reducer/2`` on). Runs only in
    ``RETRIEVING``. Under ``reducer/3`` the reads are one activity: admitted by a reservation of
    their tool calls, given a deadline-bounded timeout, and settled at the calls made."""
    lease = task_claim(task_id=task_id)
    if lease is None:
        return
    device_gone = False
    try:
        task = Task.objects.select_related("device", "tenant").get(pk=task_id)
        bind(tenant_id=task.tenant_id, task_id=task.pk, lease_generation=lease.generation, step="context_read")
        if task.status != reducer.RETRIEVING:
            return
        gen = lease.generation
        reservation, timeout = None, None
        if has_ledger(task):
            task = release_stale(task, lease)
            calls = 2 + (task.state["evidence"] is None)  # device read, ticket read, retrieval
            timeout = activity_timeout(task, wanted=settings.FAULTDESK["REFSERVICE_TIMEOUT_SECONDS"])
            if timeout is None:
                fail(task, lease, deadline_reason(task))
                return
            try:
                task, reservation = budget_reserve(task_id=task.pk, activity="context_read",
                                                   amounts={"tool_calls": calls}, actor=actor_of(lease),
                                                   lease_generation=gen, timeout_s=timeout)
            except BudgetExceeded as exc:
                fail(task, lease, exc.reason)
                return
        made = 0
        try:
            made += 1
            reading = device_read(tenant_id=task.tenant_id, device_id=task.device_id)
            if task.state["evidence"] is None:
                made += 1
                selection = evidence_select(
                    tenant_id=task.tenant_id,
                    scopes=_principal_scopes(task),
                    report=_report_text(task),
                    device=reading,
                    k=settings.FAULTDESK["RETRIEVAL_TOP_K"],
                    model=task.artifact_bundle.get("embedding_model"),
                )
                ref_dicts = [r.as_dict() for r in selection.refs]
                chosen = selection.as_dict()
                chosen.pop("refs")
                payload = {"query": _report_text(task), "refs": ref_dicts, "selection": chosen,
                           "retrieved_at": timezone.now().isoformat()}
                if flagged := refs_flags(ref_dicts) + _input_flags(task, reading):
                    payload["injection_flags"] = flagged  # shown on the trace and queue; nothing else changes
                    chosen["injection_flags"] = flagged
                task = task_append_event(
                    task=task, event_type="evidence.retrieved", actor=actor_of(lease), lease_generation=gen,
                    payload=payload,
                )
            # A device gone from the tenant: settle the reads made (below), then fail the task.
            if reading is None:
                device_gone = True
            else:
                if plans_comments(task):
                    # The device's open ticket, read at its ticket system: the plan may comment on it.
                    made += 1
                    try:
                        ticket = open_ticket_read(tenant_id=task.tenant_id, device_id=task.device_id,
                                                  connector=task.tenant.ticket_system, timeout=timeout)
                    except errors.ToolError as exc:
                        log.info("context_read %s: the ticket system cannot be read now (%s); retried later",
                                 task_id, exc)
                        return
                    task = task_append_event(task=task, event_type="ticket.read", actor=actor_of(lease),
                                             lease_generation=gen,
                                             payload={"ticket": ticket, "read_at": timezone.now().isoformat()})
                task = task_append_event(
                    task=task, event_type="device.read", actor=actor_of(lease), lease_generation=gen,
                    payload={"reading": reading, "read_at": timezone.now().isoformat()},
                )
        finally:
            if reservation is not None:
                task = budget_settle(task_id=task.pk, reservation_id=reservation.id, used={"tool_calls": made},
                                     actor=actor_of(lease), lease_generation=gen)
        if device_gone:
            fail(task, lease, "device no longer exists in the tenant")
            return
    except StaleWrite:
        log.info("context_read lost the lease on %s", task_id)
        return
    except reducer.IllegalTransition as exc:
        log.warning("context_read on %s: %s", task_id, exc)  # recorded as a refused event
        return
    finally:
        task_release(lease=lease)
    enqueue_on_commit(AGENT_STEP, task_id)
