"""``manage.py audit_approvals [--task ID ...] [--tenant SLUG]``: the binding audit of decided approvals
(DESIGN.md §7, §12 invariant 2; :func:`apps.approvals.services.approval_binding_audit`).

For each decided approval: every action sent under it carries the digest h(a) it binds and re-hashes to
it, and its own copy re-hashes to h(a) — or retention purged that copy (``purged``, checked against what
was sent only). Prints one line per approval that differs, then the counts; exits 1 when any differs.
"""

from __future__ import annotations

from collections import Counter

from django.core.management.base import BaseCommand, CommandError

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_binding_audit


class Command(BaseCommand):
    help = "Check that every decided approval binds what was sent under it (exit 1 when one differs)."

    def add_arguments(self, parser):
        parser.add_argument("--task", action="append", default=[], metavar="ID", help="only this task's approvals")
        parser.add_argument("--tenant", metavar="SLUG", help="only this tenant's approvals")

    def handle(self, *args, task, tenant, **options):
        approvals = ApprovalRequest.objects.exclude(status=ApprovalStatus.PENDING).order_by("created_at")
        if task:
            import uuid

            try:
                ids = [uuid.UUID(t) for t in task]
            except ValueError as exc:
                raise CommandError(f"--task: not a task id ({exc})") from None
            approvals = approvals.filter(task_id__in=ids)
        if tenant:
            approvals = approvals.filter(tenant__slug=tenant)
        counts: Counter = Counter()
        for approval in approvals.iterator(chunk_size=500):
            audit = approval_binding_audit(approval=approval)
            counts[audit.state] += 1
            if audit.state == "differs":
                self.stdout.write(f"approval {approval.pk} (task {approval.task_id}): differs: {audit.reason}")
        self.stdout.write("audit_approvals: " + " ".join(f"{state}={counts[state]}"
                                                          for state in ("ok", "purged", "unsent", "differs")))
        if counts["differs"]:
            raise SystemExit(1)
