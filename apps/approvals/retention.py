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

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.core.retention import Purged, column_sizes
from apps.events.retention import EXCERPTS, LEVELS, PAYLOAD, level_rank


def purgeable_approvals(tenant_id: int, level: str):
    """Approvals of ``tenant_id`` whose copies may be purged to ``level`` now: decided (not
    ``PENDING``), not yet at ``level`` or beyond, of a task purged to ``level`` or beyond (a
    queryset, not locked). Raises ``ValueError`` for an unknown level."""
    if level not in (EXCERPTS, PAYLOAD):
        raise ValueError(f"unknown purge level {level!r}")
    lower = [lv for lv in LEVELS if level_rank(lv) < level_rank(level)]
    deeper = [lv for lv in LEVELS if level_rank(lv) >= level_rank(level)]
    return (ApprovalRequest.objects.for_tenant(tenant_id)
            .exclude(status=ApprovalStatus.PENDING)
            .filter(purged__in=lower, task__purged__in=deeper))


def purge_approvals_batch(tenant_id: int, level: str, *, limit: int, at: datetime) -> Purged:
    """Purge the copies of up to ``limit`` of :func:`purgeable_approvals` that nothing holds
    (``FOR UPDATE SKIP LOCKED``) to ``level``, in one transaction, stamping ``purged_at = at``.
    Returns the rows changed and the bytes of ``params`` and ``evidence`` freed. Raises
    ``ValueError`` for an unknown level."""
    table = ApprovalRequest._meta.db_table
    with transaction.atomic():
        ids = list(purgeable_approvals(tenant_id, level).select_for_update(skip_locked=True, of=("self",))
                   .order_by("pk").values_list("pk", flat=True)[:limit])
        if not ids:
            return Purged()
        before = column_sizes(table, "params, evidence", ids)
        with connection.cursor() as cur:
            cur.execute(f"UPDATE {table} SET params = faultdesk_approval_purged_params(params, %s), "  # noqa: S608
                        "evidence = faultdesk_approval_purged_evidence(evidence, %s), purged = %s, purged_at = %s "
                        "WHERE id = ANY(%s)", [level, level, level, at, ids])
        after = column_sizes(table, "params, evidence", ids)
        return Purged(len(ids), sum(before.values()) - sum(after.values()))
