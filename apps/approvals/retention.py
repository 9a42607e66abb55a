"""Retention of approvals' copies (DESIGN.md §13 "Retention"; ADR 0020; spec agent-execution-system.md
§16.12: keep references, versions and digests, keep sensitive originals only as long as needed).

An approval keeps its own copy of what the approver was shown: the evidence refs (with their
excerpts) and the write's parameters (with the report's words in a ticket's title and description).
The binding — tool, tool version, h(a), object and V_o, V_p, scope, effects — and the decision —
status, decider, times, reason — are never changed. What the purge may do, and the database trigger
``approval_copy_purge_only`` (migration 0007) admits nothing else, is empty the text of the copies
of a decided approval whose task is already purged to the same level or beyond:

- ``"excerpts"``: every ``excerpt`` and ``quotes`` value in ``evidence`` and ``params``;
- ``"payload"``: those, and every free-text value in ``params`` (``title``, ``description``,
  ``body``, ``comment``, ``reason``, an attachment's ``name``).

The new values are computed in PostgreSQL by the same functions the trigger checks against
(``faultdesk_approval_purged_params`` / ``…_evidence``). A purged approval's binding stays
verifiable: :func:`apps.approvals.services.approval_binding_audit` compares its h(a) with the
action rows sent under it and reports it as ``purged``, never as differing.
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection, transaction
from django.db.models import Exists, OuterRef

from apps.actions.models import Action
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.core.retention import PurgeCounts, Purged, column_sizes
from apps.events.retention import EXCERPTS, LEVELS, PAYLOAD, level_rank
from apps.tasks import reducer
from apps.tasks.retention import UNRECONCILED


def purgeable_approvals(tenant_id: int, level: str):
    """Approvals of ``tenant_id`` whose copies may be purged to ``level`` now: decided (not
    ``PENDING``), not yet at ``level`` or beyond, of a task purged to ``level`` or beyond that is
    finished (terminal, no unreconciled action: a purged task that took events again — a
    compensation under a new approval — keeps its marker while it is open) (a queryset, not
    locked). Raises ``ValueError`` for an unknown level."""
    if level not in (EXCERPTS, PAYLOAD):
        raise ValueError(f"unknown purge level {level!r}")
    lower = [lv for lv in LEVELS if level_rank(lv) < level_rank(level)]
    deeper = [lv for lv in LEVELS if level_rank(lv) >= level_rank(level)]
    unreconciled = Action.objects.filter(task_id=OuterRef("task_id"), status__in=UNRECONCILED)
    return (ApprovalRequest.objects.for_tenant(tenant_id)
            .exclude(status=ApprovalStatus.PENDING)
            .filter(purged__in=lower, task__purged__in=deeper, task__status__in=sorted(reducer.TERMINAL))
            .exclude(Exists(unreconciled)))


def purge_approvals_batch(tenant_id: int, level: str, *, limit: int, at: datetime) -> Purged:
    """Purge the copies of up to ``limit`` of :func:`purgeable_approvals` that nothing holds
    (``FOR UPDATE SKIP LOCKED``) to ``level``, in one transaction, stamping ``purged_at = at``: the
    catch-up for approvals their task's batch left (decided later, locked then, or of tasks purged
    before this step existed). Returns the rows changed and the bytes of ``params`` and
    ``evidence`` freed. Raises ``ValueError`` for an unknown level."""
    with transaction.atomic():
        return _purge(purgeable_approvals(tenant_id, level), level, limit=limit, at=at)


def purge_task_approvals(task_ids: list, level: str, *, at: datetime) -> PurgeCounts:
    """Purge the copies of the decided approvals of ``task_ids`` to ``level``, in the caller's
    transaction — the task batch that has just purged those tasks to ``level``
    (:func:`apps.tasks.retention.purge_task_batch`'s ``also``). Rows another transaction holds are
    skipped (:func:`purge_approvals_batch` takes them later). Returns the counts under the
    approvals table. Raises ``ValueError`` for an unknown level."""
    if level not in (EXCERPTS, PAYLOAD):
        raise ValueError(f"unknown purge level {level!r}")
    lower = [lv for lv in LEVELS if level_rank(lv) < level_rank(level)]
    rows = (ApprovalRequest.objects.filter(task_id__in=list(task_ids), purged__in=lower)
            .exclude(status=ApprovalStatus.PENDING))
    counts = PurgeCounts()
    purged = _purge(rows, level, limit=None, at=at)
    if purged.rows:
        counts.add(ApprovalRequest._meta.db_table, purged)
    return counts


def _purge(rows, level: str, *, limit: int | None, at: datetime) -> Purged:
    """Lock ``rows`` (a queryset; at most ``limit``) that nothing holds and empty their copies to
    ``level`` with the SQL functions the trigger checks against. Call inside a transaction."""
    table = ApprovalRequest._meta.db_table
    # no order: a scan in key order reads the whole table before it finds a row (SKIP LOCKED never waits)
    ids = rows.select_for_update(skip_locked=True, of=("self",)).order_by().values_list("pk", flat=True)
    ids = list(ids[:limit] if limit is not None else ids)
    if not ids:
        return Purged()
    before = column_sizes(table, "params, evidence", ids)
    with connection.cursor() as cur:
        cur.execute(f"UPDATE {table} SET params = faultdesk_approval_purged_params(params, %s), "  # noqa: S608
                    "evidence = faultdesk_approval_purged_evidence(evidence, %s), purged = %s, purged_at = %s "
                    "WHERE id = ANY(%s)", [level, level, level, at, ids])
    after = column_sizes(table, "params, evidence", ids)
    return Purged(len(ids), sum(before.values()) - sum(after.values()))
