"""The task aggregate's services for people (DESIGN.md §1 step 1, §8): submit a fault request,
cancel it, answer the agent's questions. Each commits through :mod:`apps.tasks.store`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import structlog
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.accounts.principal import Principal
from apps.actions.registry import TOOLS
from apps.attachments.services import CheckedFile, attachments_record, attachments_store
from apps.core import sql
from apps.core.digests import sha256_json
from apps.core.errors import Conflict, Forbidden, NotFound, QuotaExceeded, Unprocessable
from apps.core.queue import READ_CONTEXT, enqueue_on_commit
from apps.devices.selectors import device_get
from apps.llm.drafter import PROMPT_TEMPLATE_VERSION
from apps.llm.parser import PARSER_VERSION
from apps.tasks import reducer
from apps.tasks.cancel_gate import cancel_gate_enter
from apps.tasks.models import Task, Urgency
from apps.tasks.selectors import task_get
from apps.tasks.store import task_append_with_retry, task_create

#: the controller new tasks are pinned to (apps/agent/controllers.py carries every version a task may pin)
CONTROLLER_VERSION = "controller/2"

#: one structured line per committed event (config.logs): tenant, task, seq, type, actor, fencing token
events_log = structlog.get_logger("faultdesk.events")


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


# --- submit ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SubmitResult:
    task: Task
    created: bool


def _request_body(*, device_id: int, symptom: str, urgency: str) -> dict:
    return {"device_id": int(device_id), "symptom": symptom, "urgency": urgency}


def task_submit(
    *, principal: Principal, device_id: int, symptom: str, urgency: str = Urgency.NORMAL,
    request_key: str | None = None, attachments: Sequence[CheckedFile] = (),
) -> SubmitResult:
    """File a fault request as ``principal`` (DESIGN.md §1 step 1).

    Creates the task pinned to tenant, principal, device, deadline, budget and artifact bundle,
    with its ``task.accepted`` event, and enqueues its first run on commit (on the tools pool: the
    context reads come first). The same ``request_key`` with the same body returns the existing task
    (``created=False``). ``attachments`` are files :func:`apps.attachments.services.attachments_check`
    passed: their bytes are stored before the task's transaction, their rows written in it, and
    their names, types, sizes and digests (a log's fault lines too) recorded in ``task.accepted``;
    their digests are part of the request an ``Idempotency-Key`` stands for.

    Raises ``Forbidden`` (principal may not file), ``NotFound`` (device not in the tenant),
    ``Unprocessable`` (invalid fields, or the same key with a different body).
    """
    if not principal.is_requester:
        raise Forbidden(_("only requesters and admins may file fault requests"))
    symptom = (symptom or "").strip()
    if not symptom or len(symptom) > 4000:
        raise Unprocessable(_("symptom must be 1..4000 characters"))
    if urgency not in Urgency.values:
        raise Unprocessable(_("urgency must be one of %(choices)s") % {"choices": Urgency.values})
    if request_key is not None and not (1 <= len(request_key) <= 200):
        raise Unprocessable(_("Idempotency-Key must be 1..200 characters"))
    device = device_get(tenant_id=principal.tenant_id, device_id=device_id)
    if device is None:
        raise NotFound(_("device %(device)s not found") % {"device": device_id})
    body = _request_body(device_id=device.pk, symptom=symptom, urgency=urgency)
    attachments = list(attachments)
    if any(not isinstance(f, CheckedFile) for f in attachments):
        raise TypeError("attachments must be checked by attachments_check first")
    # the files as recorded and approved: their bytes, names and order
    files = {"attachments": [[f.sha256, f.name] for f in attachments]} if attachments else {}
    digest = sha256_json({"user": principal.user_id, **body, **files})

    if request_key is not None:  # a key is the requester's own: another's same key is another request
        existing = sql.row(Task, "t0.requester_id = %s AND t0.request_key = %s", [principal.user_id, request_key],
                           tenant_id=principal.tenant_id)  # one at most: (requester, key) is unique
        if existing is not None:
            return _same_key(existing, digest)

    conf = settings.FAULTDESK
    keys = attachments_store(tenant_id=principal.tenant_id, files=attachments)  # the bytes, before the rows
    now = timezone.now()
    try:
        with transaction.atomic():
            _tenant_admits(principal.tenant_id)
            new = Task(
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
            # The row and its task.accepted event in one statement.
            task = task_create(
                task=new,
                event_type="task.accepted",
                payload={
                    "request": {**body, "asset_tag": device.asset_tag, "requester": principal.username,
                                "tenant": principal.tenant_slug,
                                **({"attachments": [f.metadata() for f in attachments]} if attachments else {})},
                    "budget_total": new.budget_total,
                    "limits": {"tokens": conf["TASK_TOKEN_LIMIT"], "tool_calls": conf["TASK_TOOL_CALL_LIMIT"],
                               "retries": conf["TASK_RETRY_LIMIT"]},
                    "deadline_at": new.deadline_at.isoformat(),
                    "artifact_bundle": new.artifact_bundle,
                },
                actor=principal.as_actor(),
                occurred_at=now,
            )
            if attachments:
                attachments_record(tenant_id=principal.tenant_id, task_id=task.pk, files=attachments, keys=keys)
            # The first steps (record that retrieval starts, then the context reads) run on the tools pool.
            enqueue_on_commit(READ_CONTEXT, task.pk)
    except IntegrityError:
        # A concurrent submit with the same key won the unique constraint.
        existing = Task.objects.visible_to(principal).get(requester_id=principal.user_id, request_key=request_key)
        return _same_key(existing, digest)
    return SubmitResult(task=task, created=True)


def _tenant_admits(tenant_id: int) -> None:
    """Per-tenant admission of a new request: the tenant's row is locked, so
    concurrent submits of one tenant are counted one after the other. Raises
    :class:`QuotaExceeded` (429, with ``retry_after`` seconds) when the tenant has
    ``max_active_tasks`` requests in progress (cancelled ones whose compensation is pending do not
    count), or when what is left of today's cost units (or, for a hosted model, tokens) is less
    than one request's budget: such a request could not run to its end."""
    from apps.accounts.models import Tenant
    from apps.tasks.usage import tenant_load_today

    conf = settings.FAULTDESK
    # NO KEY UPDATE: submits of one tenant still queue here, but the foreign-key checks (KEY SHARE)
    # of the tenant's other transactions — every event, action and outbox row — do not wait for it.
    tenant = sql.row(Tenant, "t0.id = %s", [tenant_id], tail="FOR NO KEY UPDATE")
    if tenant is None:
        raise Tenant.DoesNotExist(f"tenant {tenant_id}")
    quota = tenant.quota()
    # Both read after the lock (the statement's snapshot is taken once it holds it): the submits
    # that held it before are counted.
    active, usage = tenant_load_today(tenant, statuses=reducer.NON_TERMINAL)
    if active >= quota["active_tasks"]:
        if active == 1:
            detail = _("this tenant already has 1 open request (limit %(limit)s); wait for one to finish, "
                       "or cancel one")
        else:
            detail = _("this tenant already has %(active)s open requests (limit %(limit)s); wait for one to finish, "
                       "or cancel one")
        raise QuotaExceeded(detail % {"active": active, "limit": quota["active_tasks"]}, retry_after=60)
    needs = {"money": conf["TASK_BUDGET_UNITS"],
             "tokens": conf["TASK_TOKEN_LIMIT"] if conf["MODEL_PROVIDER"] != "local" else 0}
    now = timezone.now()
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    for dim in ("money", "tokens"):
        u = usage[dim]
        left = u["limit"] - u["used"] - u["reserved"]
        if needs[dim] and left < min(needs[dim], u["limit"]):
            if dim == "money":
                detail = _("this tenant has %(left)s of today's %(limit)s cost units left, less than one request's "
                           "budget (%(needed)s); new requests are accepted again after midnight UTC")
            else:
                detail = _("this tenant has %(left)s of today's %(limit)s model tokens left, less than one request's "
                           "budget (%(needed)s); new requests are accepted again after midnight UTC")
            raise QuotaExceeded(detail % {"left": max(left, 0), "limit": u["limit"],
                                          "needed": min(needs[dim], u["limit"])},
                                retry_after=max(1, int((tomorrow - now).total_seconds())))


def _same_key(existing: Task, digest: str) -> SubmitResult:
    if existing.request_digest != digest:
        raise Unprocessable(
            _("Idempotency-Key was already used with a different request body"),
            task_id=str(existing.pk),
        )
    return SubmitResult(task=existing, created=False)


# --- leases ------------------------------------------------------------------------------------


def task_cancel(*, principal: Principal, task_id: uuid.UUID, reason: str = "") -> Task:
    """Cancel a task (DESIGN.md §8): a ``cancel.requested`` event first; it stops new dispatch — also
    a request whose last re-authorization is under way, which waits for it (:mod:`apps.tasks.cancel_gate`).

    Raises ``NotFound`` (the principal may not even see it: another tenant's, or another
    requester's for a requester — the same answer as for an id that does not exist),
    ``Forbidden`` (seen, but not the requester or an admin) and ``Conflict`` (already terminal).
    """
    task = task_get(principal=principal, task_id=task_id)
    if task is None:
        raise NotFound(_("task not found"))
    if task.requester_id != principal.user_id and not principal.is_admin:
        raise Forbidden(_("only the requester or an admin may cancel"))
    with transaction.atomic():
        # before it waits for the task row: a request about to leave waits for this cancel
        cancel_gate_enter(task.pk)
        try:
            return task_append_with_retry(  # the approvals app closes the task's pending approvals (a projection)
                task_id=task.pk, event_type="cancel.requested", payload_fn=lambda t: {"reason": reason[:200]},
                actor=principal.as_actor(),
            )
        except reducer.IllegalTransition as exc:
            refused = exc  # its record is written; this transaction commits it
    status = Task.objects.filter(pk=task.pk).values_list("status", flat=True).first()  # as it is now
    # ``refused.reason`` is recorded (the refused event): it stays as recorded, in English.
    raise Conflict(_("cannot cancel: %(reason)s") % {"reason": refused.reason}, status=status) from refused


def task_provide_input(*, principal: Principal, task_id: uuid.UUID, text: str) -> Task:
    """The requester answers the agent's questions (WAITING_INPUT → re-plan from the context reads).
    Enqueues a run on the tools pool.

    Raises ``NotFound``, ``Forbidden`` (not the requester), ``Unprocessable`` (empty text) and
    ``Conflict`` (the task is not waiting for input).
    """
    text = (text or "").strip()
    if not text:
        raise Unprocessable(_("the answer is empty"))
    task = task_get(principal=principal, task_id=task_id)  # another requester's: 404, as if absent
    if task is None:
        raise NotFound(_("task not found"))
    if task.requester_id != principal.user_id:
        raise Forbidden(_("only the requester may answer"))
    try:
        task = task_append_with_retry(
            task_id=task.pk, event_type="input.provided", payload_fn=lambda t: {"text": text[:4000]},
            actor=principal.as_actor(),
        )
        enqueue_on_commit(READ_CONTEXT, task.pk)  # a re-plan starts with the context reads (tools pool)
    except reducer.IllegalTransition as exc:
        raise Conflict(_("the task is not waiting for input: %(reason)s") % {"reason": exc.reason}) from exc
    return task
