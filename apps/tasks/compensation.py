"""Failed compensations and the people who settle them (DESIGN.md §6 "saga";
spec §16.4: "补偿失败需要单独的待处理状态" — a failed compensation needs its own pending state).

A compensation (closing a ticket that a cancelled task created anyway) that failed waits in
``WAITING_COMPENSATION``: a definite failure of its action, more conflicts than
``FAULTDESK["MAX_COMPENSATION_REPLANS"]``, or a ticket system that cannot close a ticket
conditionally. An admin of the tenant then records one of:

* **retry** (``compensation.retry``): the agent re-reads the ticket and asks for a new approval;
* **resolved** (``compensation.resolved``): ``done_by_hand`` (someone closed it at the ticket
  system) or ``not_needed`` (the ticket should stay), with a note.

Both are events with the person as actor, appended under the task's CAS like any other.
"""

from __future__ import annotations

import uuid

from django.utils.translation import gettext as _

from apps.accounts.principal import Principal
from apps.core.errors import Conflict, Forbidden, NotFound, Unprocessable
from apps.core.queue import AGENT_STEP, enqueue_on_commit
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.store import StaleWrite, task_append_event

MAX_NOTE = 1000


def _require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise Forbidden(_("only an admin may settle a compensation"))


def compensations_waiting(*, principal: Principal) -> list[Task]:
    """The principal's tenant's tasks whose compensation failed (``WAITING_COMPENSATION``),
    oldest first, with device and requester. Raises ``Forbidden`` for a non-admin."""
    _require_admin(principal)
    return list(Task.objects.visible_to(principal).filter(status=reducer.WAITING_COMPENSATION)
                .select_related("device", "requester").order_by("updated_at"))


def compensation_settle(*, principal: Principal, task_id: uuid.UUID, decision: str, note: str = "") -> Task:
    """Record an admin's decision on a failed compensation and return the task.

    ``decision`` is ``"retry"``, ``"done_by_hand"`` or ``"not_needed"``; ``note`` (1..1000
    characters) says why. Raises ``NotFound`` (not a task of the principal's tenant),
    ``Forbidden`` (not an admin), ``Unprocessable`` (bad decision or note) and ``Conflict`` (the
    task is not waiting for a compensation decision, or moved meanwhile)."""

    _require_admin(principal)
    if decision not in ("retry", "done_by_hand", "not_needed"):
        raise Unprocessable(_("decision must be 'retry', 'done_by_hand' or 'not_needed'"))
    note = (note or "").strip()
    if not note:
        raise Unprocessable(_("say why (note)"))
    if len(note) > MAX_NOTE:
        raise Unprocessable(_("the note is limited to %(max)s characters") % {"max": MAX_NOTE})
    task = Task.objects.visible_to(principal).filter(pk=task_id).first()
    if task is None:
        raise NotFound(_("task not found"))
    if task.status != reducer.WAITING_COMPENSATION:
        raise Conflict(_("the task is %(status)s: no failed compensation to settle") % {"status": task.status},
                       status=task.status)
    actor = principal.as_actor()
    try:
        if decision == "retry":
            task = task_append_event(task=task, event_type="compensation.retry", actor=actor,
                                     payload={"by": principal.username, "note": note})
            enqueue_on_commit(AGENT_STEP, task.pk)
        else:
            task = task_append_event(task=task, event_type="compensation.resolved", actor=actor,
                                     payload={"outcome": decision, "by": principal.username, "note": note})
    except (StaleWrite, reducer.IllegalTransition) as exc:
        raise Conflict(_("the task changed meanwhile; look again (%(reason)s)") % {"reason": exc}) from exc
    return task
