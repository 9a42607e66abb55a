"""Writes to the task aggregate: submit, the CAS commit of an event, leases with fencing tokens
(DESIGN.md §4, §5; spec §16.3 "并发恢复版本约束").

Commit = ``UPDATE task SET … , version = v + 1 WHERE id = ? AND version = v [AND lease_generation
= g]`` plus the event insert, in one transaction. Zero rows updated means the writer lost: it
re-reads, it never overwrites.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import structlog
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts.api import Conflict, Forbidden, NotFound, QuotaExceeded, Unprocessable
from apps.accounts.principal import Principal
from apps.actions.digest import sha256_json
from apps.actions.registry import TOOLS
from apps.devices.selectors import device_get
from apps.events.models import RefusedEvent, TaskEvent, TaskSnapshot
from apps.llm.drafter import PROMPT_TEMPLATE_VERSION
from apps.llm.parser import PARSER_VERSION
from apps.tasks import reducer
from apps.tasks.failpoints import failpoint
from apps.tasks.models import Task, Urgency
from apps.tasks.selectors import task_get

CONTROLLER_VERSION = "controller/1"

#: one structured line per committed event (config.logs): tenant, task, seq, type, actor, fencing token
events_log = structlog.get_logger("faultdesk.events")


class StaleWrite(Exception):
    """The CAS lost: the task moved past ``expected_version`` or the lease passed to another
    worker (fencing token ``lease_generation`` no longer current)."""


def worker_identity() -> str:
    """``host:pid`` of this process — the lease owner string."""
    return f"{socket.gethostname()}:{os.getpid()}"


def artifact_bundle_current() -> dict:
    """The artifact bundle pinned on a new task (spec §16.2: model, prompt template, tool
    schemas, controller and parser versions; plus the reducer version replay must use)."""
    from apps.llm.providers import bundle_entries

    return {
        **bundle_entries(settings.FAULTDESK),
        "prompt_template": PROMPT_TEMPLATE_VERSION,
        "tool_schemas": {name: contract.version for name, contract in TOOLS.items()},
        "controller": CONTROLLER_VERSION,
        "parser": PARSER_VERSION,
        "reducer": reducer.CURRENT,
        "embedding_model": settings.FAULTDESK["EMBEDDING_MODEL"],
    }


def _state_digest(state: dict) -> str:
    return sha256_json(state)


def _cut(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, marked with "…" when cut (the full text stays in
    the event)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _apply_row(task: Task, new_state: dict) -> dict:
    """Columns of the materialized state derived from the reducer state."""
    b = new_state["budget"]
    return {
        "status": new_state["status"],
        "state": new_state,
        "termination_reason": _cut(new_state.get("termination_reason") or "", 300),
        "budget_total": b["total"],
        "budget_used": b["used"],
        "budget_reserved": b["reserved"],
    }


def task_append_event(
    *,
    task: Task,
    event_type: str,
    payload: dict,
    actor: str,
    lease_generation: int | None = None,
    causation_id: uuid.UUID | None = None,
    occurred_at=None,
    side_effects: Callable[[Task, TaskEvent], None] | None = None,
) -> Task:
    """Apply δ to ``task`` (as read, at ``task.version``) and commit the event with CAS.

    When ``lease_generation`` is given, the commit also requires the task's fencing token to be
    still ``lease_generation`` (only the lease holder may commit). ``side_effects(task, event)``
    runs inside the same transaction (approval rows, action + outbox rows, ...).

    Returns the updated task. Raises :class:`reducer.IllegalTransition` when δ refuses the event
    and :class:`StaleWrite` when the CAS loses (version moved or fencing token superseded); both
    are first recorded as a :class:`RefusedEvent`, never applied.
    """
    try:
        try:
            reduce = reducer.reducer_for((task.artifact_bundle or {}).get("reducer"))
        except reducer.UnknownReducer as exc:
            raise reducer.IllegalTransition(task.status, event_type, str(exc)) from exc
        new_state = reduce(task.state, event_type, payload)
    except reducer.IllegalTransition as exc:
        refused_event_record(task=task, event_type=event_type, payload=payload, reason=exc.reason, actor=actor,
                             lease_generation=lease_generation)
        raise
    expected = task.version
    now = timezone.now()
    failpoint(f"before_commit:{event_type}")
    try:
        with transaction.atomic():
            filt = Q(pk=task.pk, version=expected)
            if lease_generation is not None:
                filt &= Q(lease_generation=lease_generation)
            columns = _apply_row(task, new_state)
            updated = Task.objects.filter(filt).update(version=expected + 1, updated_at=now, **columns)
            if updated != 1:
                raise StaleWrite(f"task {task.pk}: expected version {expected}, generation {lease_generation}")
            event = TaskEvent.objects.create(
                task_id=task.pk,
                tenant_id=task.tenant_id,
                seq=expected + 1,
                type=event_type,
                payload=payload,
                payload_digest=sha256_json(payload),
                occurred_at=occurred_at or now,
                causation_id=causation_id,
                actor=actor,
                lease_generation=lease_generation if lease_generation is not None else task.lease_generation,
            )
            every = settings.FAULTDESK["SNAPSHOT_EVERY"]
            if every and (expected + 1) % every == 0:
                TaskSnapshot.objects.create(
                    task_id=task.pk, seq=expected + 1, state=new_state, digest=_state_digest(new_state),
                    reducer_version=(task.artifact_bundle or {}).get("reducer", reducer.REDUCER_VERSION),
                )
            if "limits" in new_state:
                from apps.tasks.budget import tenant_ledger_apply

                tenant_ledger_apply(task, task.state, new_state)  # BudgetExceeded rolls the event back
            if side_effects is not None:
                side_effects(task, event)
            if new_state["status"] in reducer.TERMINAL and task.status not in reducer.TERMINAL:
                _close_pending_approvals(task, new_state)
    except StaleWrite:
        refused_event_record(task=task, event_type=event_type, payload=payload,
                             reason=_stale_reason(task.pk, expected, lease_generation), actor=actor,
                             lease_generation=lease_generation)
        raise
    events_log.info("event.appended", tenant_id=str(task.tenant_id), task_id=str(task.pk), event_seq=expected + 1,
                    event_type=event_type, actor=actor, lease_generation=lease_generation, status=new_state["status"])
    # The in-memory task follows the row only once the transaction committed.
    for field, value in columns.items():
        setattr(task, field, value)
    task.version = expected + 1
    # "After commit" means after the outermost commit: inside a caller's transaction (a receipt
    # recorded with its action and outbox rows) the failpoint waits for that commit.
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: failpoint(f"after_commit:{event_type}"))
    else:
        failpoint(f"after_commit:{event_type}")
    return task


def _close_pending_approvals(task: Task, new_state: dict) -> None:
    """A task that ends leaves nothing to decide: its pending approvals are invalidated in the
    same transaction, with the reason (the queue shows them as such, and a late decision gets 409)."""
    from apps.approvals.models import ApprovalRequest, ApprovalStatus

    reason = f"the task ended ({new_state['status']}: {new_state.get('termination_reason') or ''})"
    ApprovalRequest.objects.for_tenant(task.tenant_id).filter(task_id=task.pk, status=ApprovalStatus.PENDING).update(
        status=ApprovalStatus.INVALIDATED, reason=reason[:2000])


def _stale_reason(task_id, expected: int, generation: int | None) -> str:
    row = Task.objects.filter(pk=task_id).values("version", "lease_generation").first() or {}
    if generation is not None and row.get("lease_generation") != generation:
        return (f"stale write: lease lost (fencing token {generation}, current {row.get('lease_generation')}); "
                "not applied")
    return f"stale write: version moved ({expected} expected, now {row.get('version')}); not applied"


def refused_event_record(*, task: Task, event_type: str, payload: dict, reason: str, actor: str,
                         lease_generation: int | None = None) -> RefusedEvent:
    """Record an event δ refused (DESIGN.md §4: late or illegal events are recorded, never
    applied). A caller whose own transaction rolls back after a refusal records it again after
    the rollback, so the record is not lost with it."""
    return RefusedEvent.objects.create(
        task_id=task.pk, tenant_id=task.tenant_id, at_version=task.version, type=event_type, payload=payload,
        reason=reason[:300], actor=actor, lease_generation=lease_generation,
    )


def task_append_with_retry(
    *, task_id: uuid.UUID, event_type: str, payload_fn: Callable[[Task], dict], actor: str, attempts: int = 5,
    side_effects: Callable[[Task, TaskEvent], None] | None = None,
) -> Task:
    """Append an event that does not need the lease (a person's decision, a cancel, a receipt).
    The task row is locked (``SELECT … FOR UPDATE``) and read fresh, so the CAS cannot lose to
    the ledger's writers, which lock the same row; ``attempts`` only guards against the
    unexpected. ``payload_fn(task)`` builds the payload from the freshly read task.

    Raises :class:`reducer.IllegalTransition` (recorded as refused, also when this function's
    savepoint rolled the first record back) and :class:`StaleWrite` if every attempt lost."""
    for _ in range(attempts):
        try:
            with transaction.atomic():
                task = Task.objects.select_for_update().get(pk=task_id)
                payload = payload_fn(task)
                return task_append_event(task=task, event_type=event_type, payload=payload, actor=actor,
                                         side_effects=side_effects)
        except StaleWrite:
            continue
        except reducer.IllegalTransition as exc:
            task = Task.objects.get(pk=task_id)
            refused_event_record(task=task, event_type=event_type, payload=payload, reason=exc.reason, actor=actor)
            raise
    raise StaleWrite(f"task {task_id}: {attempts} CAS attempts lost")


# --- submit ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SubmitResult:
    task: Task
    created: bool


def _request_body(*, device_id: int, symptom: str, urgency: str) -> dict:
    return {"device_id": int(device_id), "symptom": symptom, "urgency": urgency}


def task_submit(
    *, principal: Principal, device_id: int, symptom: str, urgency: str = Urgency.NORMAL,
    request_key: str | None = None,
) -> SubmitResult:
    """File a fault request as ``principal`` (DESIGN.md §1 step 1).

    Creates the task pinned to tenant, principal, device, deadline, budget and artifact bundle,
    with its ``task.accepted`` event, and enqueues the first agent step on commit. The same
    ``request_key`` with the same body returns the existing task (``created=False``).

    Raises ``Forbidden`` (principal may not file), ``NotFound`` (device not in the tenant),
    ``Unprocessable`` (invalid fields, or the same key with a different body).
    """
    from apps.tasks.tasks import enqueue_agent_step

    if not principal.is_requester:
        raise Forbidden("only requesters and admins may file fault requests")
    symptom = (symptom or "").strip()
    if not symptom or len(symptom) > 4000:
        raise Unprocessable("symptom must be 1..4000 characters")
    if urgency not in Urgency.values:
        raise Unprocessable(f"urgency must be one of {Urgency.values}")
    if request_key is not None and not (1 <= len(request_key) <= 200):
        raise Unprocessable("Idempotency-Key must be 1..200 characters")
    device = device_get(tenant_id=principal.tenant_id, device_id=device_id)
    if device is None:
        raise NotFound(f"device {device_id} not found")
    body = _request_body(device_id=device.pk, symptom=symptom, urgency=urgency)
    digest = sha256_json({"user": principal.user_id, **body})

    if request_key is not None:  # a key is the requester's own: another's same key is another request
        existing = Task.objects.visible_to(principal).filter(requester_id=principal.user_id,
                                                             request_key=request_key).first()
        if existing is not None:
            return _same_key(existing, digest)

    conf = settings.FAULTDESK
    now = timezone.now()
    try:
        with transaction.atomic():
            _tenant_admits(principal.tenant_id)
            task = Task.objects.create(
                tenant_id=principal.tenant_id,
                requester_id=principal.user_id,
                device=device,
                symptom=symptom,
                urgency=urgency,
                status=reducer.ACCEPTED,
                deadline_at=now + timedelta(seconds=conf["TASK_DEADLINE_SECONDS"]),
                budget_total=conf["TASK_BUDGET_UNITS"],
                artifact_bundle=artifact_bundle_current(),
                request_key=request_key,
                request_digest=digest,
                version=0,
                state=reducer.initial_state(),
            )
            task_append_event(
                task=task,
                event_type="task.accepted",
                payload={
                    "request": {**body, "asset_tag": device.asset_tag, "requester": principal.username,
                                "tenant": principal.tenant_slug},
                    "budget_total": task.budget_total,
                    "limits": {"tokens": conf["TASK_TOKEN_LIMIT"], "tool_calls": conf["TASK_TOOL_CALL_LIMIT"],
                               "retries": conf["TASK_RETRY_LIMIT"]},
                    "deadline_at": task.deadline_at.isoformat(),
                    "artifact_bundle": task.artifact_bundle,
                },
                actor=principal.as_actor(),
                occurred_at=now,
            )
            enqueue_agent_step(task.pk)
    except IntegrityError:
        # A concurrent submit with the same key won the unique constraint.
        existing = Task.objects.visible_to(principal).get(requester_id=principal.user_id, request_key=request_key)
        return _same_key(existing, digest)
    return SubmitResult(task=task, created=True)


def _tenant_admits(tenant_id: int) -> None:
    """Per-tenant admission of a new request (issue 7 item 1): the tenant's row is locked, so
    concurrent submits of one tenant are counted one after the other. Raises
    :class:`QuotaExceeded` (429, with ``retry_after`` seconds) when the tenant has
    ``max_active_tasks`` requests in progress (cancelled ones whose compensation is pending do not
    count), or when what is left of today's cost units (or, for a hosted model, tokens) is less
    than one request's budget: such a request could not run to its end."""
    from apps.accounts.models import Tenant
    from apps.tasks.budget import tenant_usage_today

    conf = settings.FAULTDESK
    tenant = Tenant.objects.select_for_update().get(pk=tenant_id)
    quota = tenant.quota()
    active = Task.objects.for_tenant(tenant_id).filter(status__in=reducer.NON_TERMINAL).count()
    if active >= quota["active_tasks"]:
        noun = "request" if active == 1 else "requests"
        raise QuotaExceeded(f"this tenant already has {active} open {noun} (limit {quota['active_tasks']}); "
                            "wait for one to finish, or cancel one", retry_after=60)
    usage = tenant_usage_today(tenant)
    needs = {"money": conf["TASK_BUDGET_UNITS"],
             "tokens": conf["TASK_TOKEN_LIMIT"] if conf["MODEL_PROVIDER"] != "local" else 0}
    now = timezone.now()
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    for dim, words in (("money", "cost units"), ("tokens", "model tokens")):
        u = usage[dim]
        left = u["limit"] - u["used"] - u["reserved"]
        if needs[dim] and left < min(needs[dim], u["limit"]):
            raise QuotaExceeded(f"this tenant has {max(left, 0)} of today's {u['limit']} {words} left, less than one "
                                f"request's budget ({min(needs[dim], u['limit'])}); new requests are accepted again "
                                "after midnight UTC", retry_after=max(1, int((tomorrow - now).total_seconds())))


def _same_key(existing: Task, digest: str) -> SubmitResult:
    if existing.request_digest != digest:
        raise Unprocessable(
            "Idempotency-Key was already used with a different request body",
            task_id=str(existing.pk),
        )
    return SubmitResult(task=existing, created=False)


# --- leases ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lease:
    """A claim on a task: ``generation`` is the fencing token every commit must carry."""

    task_id: uuid.UUID
    owner: str
    generation: int


def compensation_due_q() -> Q:
    """Tasks a compensation is due for (``reducer/2``): cancelled, their ticket created anyway
    (a receipt of kind ticket: no ``kind`` key), and no compensation asked for yet. Terminal, yet
    still claimable by the agent, which asks for the compensation."""
    return (Q(status=reducer.CANCELLED, artifact_bundle__reducer__in=reducer.V2_PLAN,
              state__compensation=None)
            & ~Q(state__receipt=None) & Q(state__receipt__kind__isnull=True))


def task_claim(*, task_id: uuid.UUID, owner: str | None = None, seconds: int | None = None) -> Lease | None:
    """Claim the lease of a non-terminal task that nobody holds (or whose lease expired) — or of
    a cancelled task a compensation is due for (:func:`compensation_due_q`).

    Increments the fencing token. Returns the :class:`Lease`, or None when another worker holds
    a live lease or the task is terminal / gone.
    """
    owner = owner or worker_identity()
    seconds = seconds or settings.FAULTDESK["LEASE_SECONDS"]
    now = timezone.now()
    with transaction.atomic():
        task = (
            Task.objects.select_for_update(skip_locked=True)
            .filter(pk=task_id)
            .filter(~Q(status__in=reducer.TERMINAL) | compensation_due_q())
            .filter(Q(lease_owner__isnull=True) | Q(lease_expires_at__lt=now))
            .first()
        )
        if task is None:
            return None
        task.lease_owner = owner
        task.lease_expires_at = now + timedelta(seconds=seconds)
        task.lease_generation += 1
        task.save(update_fields=["lease_owner", "lease_expires_at", "lease_generation"])
    return Lease(task_id=task.pk, owner=owner, generation=task.lease_generation)


def task_lease_renew(*, lease: Lease, seconds: int | None = None) -> None:
    """Extend a lease we still hold (same fencing token) by ``seconds`` (default
    ``LEASE_SECONDS``) from now, before a long activity. Raises :class:`StaleWrite` when the lease
    passed to another worker."""
    seconds = seconds or settings.FAULTDESK["LEASE_SECONDS"]
    renewed = Task.objects.filter(pk=lease.task_id, lease_generation=lease.generation).update(
        lease_owner=lease.owner, lease_expires_at=timezone.now() + timedelta(seconds=seconds))
    if not renewed:
        raise StaleWrite(f"task {lease.task_id}: lease {lease.generation} passed on; not renewed")


def task_release(*, lease: Lease) -> bool:
    """Give the lease back if it is still ours (same fencing token). Returns True if released."""
    return bool(
        Task.objects.filter(pk=lease.task_id, lease_generation=lease.generation).update(
            lease_owner=None, lease_expires_at=None
        )
    )


def task_cancel(*, principal: Principal, task_id: uuid.UUID, reason: str = "") -> Task:
    """Cancel a task (DESIGN.md §8): a ``cancel.requested`` event first; it stops new dispatch.

    Raises ``NotFound`` (the principal may not even see it: another tenant's, or another
    requester's for a requester — the same answer as for an id that does not exist),
    ``Forbidden`` (seen, but not the requester or an admin) and ``Conflict`` (already terminal).
    """
    task = task_get(principal=principal, task_id=task_id)
    if task is None:
        raise NotFound("task not found")
    if task.requester_id != principal.user_id and not principal.is_admin:
        raise Forbidden("only the requester or an admin may cancel")
    from apps.approvals.models import ApprovalRequest, ApprovalStatus

    def close_pending_approvals(t: Task, event) -> None:
        ApprovalRequest.objects.filter(task_id=t.pk, status=ApprovalStatus.PENDING).update(
            status=ApprovalStatus.INVALIDATED, reason="the task was cancelled"
        )

    try:
        return task_append_with_retry(
            task_id=task.pk, event_type="cancel.requested", payload_fn=lambda t: {"reason": reason[:200]},
            actor=principal.as_actor(), side_effects=close_pending_approvals,
        )
    except reducer.IllegalTransition as exc:
        raise Conflict(f"cannot cancel: {exc.reason}", status=task.status) from exc


def task_provide_input(*, principal: Principal, task_id: uuid.UUID, text: str) -> Task:
    """The requester answers the agent's questions (WAITING_INPUT → re-plan). Enqueues the agent.

    Raises ``NotFound``, ``Forbidden`` (not the requester), ``Unprocessable`` (empty text) and
    ``Conflict`` (the task is not waiting for input).
    """
    from apps.tasks.tasks import enqueue_agent_step

    text = (text or "").strip()
    if not text:
        raise Unprocessable("the answer is empty")
    task = task_get(principal=principal, task_id=task_id)  # another requester's: 404, as if absent
    if task is None:
        raise NotFound("task not found")
    if task.requester_id != principal.user_id:
        raise Forbidden("only the requester may answer")
    try:
        task = task_append_with_retry(
            task_id=task.pk, event_type="input.provided", payload_fn=lambda t: {"text": text[:4000]},
            actor=principal.as_actor(),
        )
        enqueue_agent_step(task.pk)
    except reducer.IllegalTransition as exc:
        raise Conflict(f"the task is not waiting for input: {exc.reason}") from exc
    return task
