"""Audit of a task's actions against its event-sourced state and, optionally, against the ticket
system itself (DESIGN.md §12 invariants 2 and 7; spec §16.3 "replay").

Replay proves the task row equals its event log. This proves the rest of the record agrees:

* the action in the task's state is the newest action row of the task, with the matching status
  (``FAILED`` in the state is ``FAILED`` or ``NOT_SENT`` on the row; a ``SUCCEEDED`` row whose
  receipt the task has not recorded yet agrees with an action still in flight: the outbox records
  a batch's receipts on its rows first) and, once recorded, the receipt's ticket id;
* every earlier action of the task is settled (never ``INTENDED`` or ``UNKNOWN`` behind a newer
  one) and none of them succeeded — a task has at most one effect; when the state holds no action
  (an approval invalidated before sending sends the task back to re-plan), every action row is
  ``NOT_SENT`` or ``FAILED``;
* with ``remote=True``, at the ticket system each action was sent to (its ``connector``): a
  ``SUCCEEDED`` action's key finds exactly its ticket, and a ``NOT_SENT`` or ``FAILED`` action's
  key finds nothing. Actions still in flight (``INTENDED``, ``UNKNOWN``) are not judged against
  the remote.

The audit only reads (the remote lookup is a lookup by key).
"""

from __future__ import annotations

from apps.actions.models import Action, ActionStatus
from config.logs import bound

#: task-state action status -> the action row statuses that agree with it
_AGREES = {
    "INTENDED": {ActionStatus.INTENDED},
    "UNKNOWN": {ActionStatus.UNKNOWN},
    "SUCCEEDED": {ActionStatus.SUCCEEDED},
    "FAILED": {ActionStatus.FAILED, ActionStatus.NOT_SENT},
}


def task_actions_audit(task, *, remote: bool = False) -> list[str]:
    """Return the disagreements found for ``task`` (a :class:`~apps.tasks.models.Task`) as
    human-readable strings; an empty list means the record is consistent.

    The task's own actions are checked against ``state["action"]`` and, for ``reducer/2``, its
    compensation actions (rows with ``compensates`` set) against ``state["compensation"]["action"]``,
    each group by the same rules.

    ``remote``: also ask each action's ticket system by key, with the tool's own result lookup
    (False: the database only). A lookup that fails raises the connector's
    :class:`~apps.actions.errors.ToolError`."""
    state = task.state or {}
    actions = list(Action.objects.filter(task_id=task.pk).order_by("created_at"))
    compensation = state.get("compensation") or {}
    problems = _group_audit([a for a in actions if a.compensates_id is None], state.get("action"),
                            state.get("receipt"), "", str(task.status))
    problems += _group_audit([a for a in actions if a.compensates_id is not None], compensation.get("action"),
                             compensation.get("receipt"), "compensation ")
    if remote:
        from apps.tickets.connectors import connector_for

        for action in actions:
            problems.extend(_remote_disagreement(action, connector_for(action.tool, action.connector)))
    return problems


def _settling(row: Action, current: dict, receipt: dict | None, status: str) -> bool:
    """A receipt the outbox recorded on the task's own action row that the task has not recorded
    yet: the row is SUCCEEDED, the task DISPATCHING or CANCELLED with the action INTENDED and no
    receipt. The dispatcher's batch records such receipts on its rows and the tasks after its
    commit (a message, or the sweeper's agent step), so this is a state on its way, not a
    disagreement. Nothing else is: a compensation's receipt, or an action the state says is
    UNKNOWN or FAILED, is recorded with its event in one transaction."""
    return (row.status == ActionStatus.SUCCEEDED and current["status"] == "INTENDED" and receipt is None
            and status in ("DISPATCHING", "CANCELLED"))


def _group_audit(actions: list[Action], current: dict | None, receipt: dict | None, what: str,
                 status: str = "") -> list[str]:
    problems: list[str] = []
    if current is None:
        # The state drops an action that was invalidated (or hit a conflict) before it was sent
        # (re-plan): its row must say so.
        problems.extend(f"{what}action {a.pk} is {a.status} but the task state holds no {what}action"
                        for a in actions if a.status not in (ActionStatus.NOT_SENT, ActionStatus.FAILED))
        actions_behind = []
    else:
        actions_behind = actions[:-1]
        newest = actions[-1] if actions else None
        if newest is None or str(newest.pk) != current["id"]:
            problems.append(f"the state's {what}action {current['id']} is not the task's newest {what}action row")
        elif newest.status not in _AGREES.get(current["status"], set()) \
                and not (what == "" and _settling(newest, current, receipt, status)):
            problems.append(f"{what}action {newest.pk}: state says {current['status']}, row says {newest.status}")
        if receipt is not None and newest is not None and newest.external_id != receipt["external_id"]:
            problems.append(f"{what}receipt {receipt['external_id']} but the action row holds "
                            f"{newest.external_id or 'none'}")
    for older in actions_behind:
        if older.status in (ActionStatus.INTENDED, ActionStatus.UNKNOWN, ActionStatus.SUCCEEDED):
            problems.append(f"superseded {what}action {older.pk} is {older.status}")
    return problems


def _remote_disagreement(action: Action, remote) -> list[str]:
    if action.status in (ActionStatus.INTENDED, ActionStatus.UNKNOWN):
        return []
    with bound(tenant_id=action.tenant_id, task_id=action.task_id):  # the gateway records the call with them
        found = remote.lookup(tool=action.tool, idempotency_key=action.idempotency_key, params=action.params)
    if action.status == ActionStatus.SUCCEEDED:
        if found is None:
            return [f"action {action.pk} recorded ticket {action.external_id}; the remote has none for its key"]
        if found.external_id != action.external_id:
            return [f"action {action.pk} recorded ticket {action.external_id}; the remote has {found.external_id}"]
        return []
    if found is not None:
        return [f"action {action.pk} is recorded {action.status} (not executed) but the remote holds "
                f"ticket {found.external_id} for its key"]
    return []
