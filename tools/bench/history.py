"""A large task history from a few real tasks, for the retention purge's test and bench
(``tests/test_retention_history.py``, ``python -m tools.bench.retention``).

:func:`clone_history` copies template tasks — each driven through the real main job — ``copies``
times with ``COPY … FROM STDIN``: the task row, its events (and refused events), its approvals, its
actions with their attempts and outbox rows. Each copy gets new ids for the task, its approvals and
its actions, and a new idempotency key per action (``<key>~<n>``); every occurrence of an old id
or key inside the state and the event payloads is rewritten, and the digest of each payload that
changed is recomputed, so a copy replays to its row and its action rows agree with its state. Its
clock is moved back by its age (created, updated, occurred, recorded, delivered, finished).
Snapshots, ticket mirrors and attachments are not copied.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

from django.db import connection, transaction

from apps.actions.models import Action, ActionAttempt
from apps.approvals.models import ApprovalRequest
from apps.core.digests import sha256_json
from apps.events.models import RefusedEvent, TaskEvent
from apps.outbox.models import OutboxMessage
from apps.tasks.models import Task

#: (model, time columns moved back by the copy's age)
_TIMES = {
    Task: ("created_at", "updated_at", "deadline_at", "lease_expires_at"),
    TaskEvent: ("occurred_at", "recorded_at"),
    RefusedEvent: ("recorded_at",),
    ApprovalRequest: ("created_at", "decided_at", "expires_at", "respond_by"),
    Action: ("created_at", "updated_at", "last_reconciled_at"),
    ActionAttempt: ("started_at", "finished_at"),
    OutboxMessage: ("created_at", "available_at", "delivered_at", "lease_expires_at"),
}


def _fields(model, skip=()):
    return [f for f in model._meta.concrete_fields if f.column not in skip]


def _rows(model, **filters) -> list[dict]:
    fields = _fields(model)
    return [dict(zip([f.column for f in fields], values, strict=True))
            for values in model.objects.filter(**filters).values_list(*[f.attname for f in fields])]


class _Template:
    """A template task's rows, read once."""

    def __init__(self, task: Task):
        self.task = _rows(Task, pk=task.pk)[0]
        self.events = _rows(TaskEvent, task_id=task.pk)
        self.refused = _rows(RefusedEvent, task_id=task.pk)
        self.approvals = _rows(ApprovalRequest, task_id=task.pk)
        self.actions = _rows(Action, task_id=task.pk)
        self.attempts = _rows(ActionAttempt, action__task_id=task.pk)
        self.outbox = _rows(OutboxMessage, action__task_id=task.pk)
        self.state_text = json.dumps(self.task["state"])
        self.payload_texts = [json.dumps(e["payload"]) for e in self.events]
        self.refused_texts = [json.dumps(e["payload"]) for e in self.refused]


def _rewrite(text: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def clone_history(templates: list[Task], copies: int, ages_days, *, now: datetime, first: int = 0) -> list[uuid.UUID]:
    """``copies`` copies of each template, the k-th copy of every template ``ages_days[k]`` days
    old (a sequence of floats, one per copy), numbered from ``first`` (a copy's number is in its
    idempotency keys: a history built in several calls numbers each call's copies after the last
    one's). One transaction. Returns the new task ids."""
    reads = [_Template(t) for t in templates]
    new_ids: list[uuid.UUID] = []
    buffers: dict[type, list[tuple]] = {m: [] for m in _TIMES}
    for k in range(copies):
        shift = timedelta(days=float(ages_days[k]))
        for tpl in reads:
            new_ids.append(_clone_one(tpl, first + k, shift, now, buffers))
    with transaction.atomic():
        for model, rows in buffers.items():
            _copy_in(model, rows)
    return new_ids


def _moved(row: dict, model, shift: timedelta, template_now: datetime, now: datetime) -> dict:
    out = dict(row)
    for col in _TIMES[model]:
        if out.get(col) is not None:
            out[col] = out[col] - (template_now - now) - shift
    return out


def _clone_one(tpl: _Template, k: int, shift: timedelta, now: datetime, buffers) -> uuid.UUID:
    task_id = uuid.uuid4()
    template_now = tpl.task["updated_at"]
    pairs = [(str(tpl.task["id"]), str(task_id))]
    approval_ids = {a["id"]: uuid.uuid4() for a in tpl.approvals}
    action_ids = {a["id"]: uuid.uuid4() for a in tpl.actions}
    keys = {a["idempotency_key"]: f"{a['idempotency_key']}~{k}" for a in tpl.actions}
    pairs += [(str(o), str(n)) for o, n in {**approval_ids, **action_ids}.items()]
    pairs += [(f'"{o}"', f'"{n}"') for o, n in keys.items()]

    task = _moved(tpl.task, Task, shift, template_now, now)
    task.update(id=task_id, request_key=None, lease_owner=None, lease_expires_at=None,
                state=_rewrite(tpl.state_text, pairs))
    buffers[Task].append(task)
    for e, text in zip(tpl.events, tpl.payload_texts, strict=True):
        row = _moved(e, TaskEvent, shift, template_now, now)
        new_text = _rewrite(text, pairs)
        row.update(id=uuid.uuid4(), task_id=task_id, payload=new_text)
        if new_text != text:
            row["payload_digest"] = sha256_json(json.loads(new_text))
        buffers[TaskEvent].append(row)
    for e, text in zip(tpl.refused, tpl.refused_texts, strict=True):
        row = _moved(e, RefusedEvent, shift, template_now, now)
        row.update(id=None, task_id=task_id, payload=_rewrite(text, pairs))
        buffers[RefusedEvent].append(row)
    for a in tpl.approvals:
        row = _moved(a, ApprovalRequest, shift, template_now, now)
        row.update(id=approval_ids[a["id"]], task_id=task_id, params=_rewrite(json.dumps(a["params"]), pairs),
                   evidence=json.dumps(a["evidence"]))
        buffers[ApprovalRequest].append(row)
    for a in tpl.actions:
        row = _moved(a, Action, shift, template_now, now)
        row.update(id=action_ids[a["id"]], task_id=task_id, idempotency_key=keys[a["idempotency_key"]],
                   approval_id=approval_ids.get(a["approval_id"]), compensates_id=action_ids.get(a["compensates_id"]),
                   params=json.dumps(a["params"]))
        for col in ("receipt", "last_error", "last_reconcile_error"):
            row[col] = None if row[col] is None else _rewrite(json.dumps(row[col]), pairs)
        buffers[Action].append(row)
    for at in tpl.attempts:
        row = _moved(at, ActionAttempt, shift, template_now, now)
        row.update(id=None, action_id=action_ids[at["action_id"]],
                   error=None if at["error"] is None else json.dumps(at["error"]))
        buffers[ActionAttempt].append(row)
    for m in tpl.outbox:
        row = _moved(m, OutboxMessage, shift, template_now, now)
        row.update(id=uuid.uuid4(), action_id=action_ids[m["action_id"]], lease_owner=None,
                   ordering_key=_rewrite(m["ordering_key"], pairs),
                   last_error=None if m["last_error"] is None else json.dumps(m["last_error"]))
        buffers[OutboxMessage].append(row)
    return task_id


def _copy_in(model, rows: list[dict]) -> None:
    """``COPY`` ``rows`` into ``model``'s table; an ``id`` of None is left to the column default."""
    if not rows:
        return
    auto_id = rows[0].get("id", 0) is None
    fields = [f for f in _fields(model) if not (auto_id and f.primary_key)]
    cols = [f.column for f in fields]
    json_cols = {f.column for f in fields if f.get_internal_type() == "JSONField"}
    table = model._meta.db_table
    with connection.cursor() as cur:
        with cur.cursor.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row([_as_json(row[c]) if c in json_cols else row[c] for c in cols])


def _as_json(value):
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)
