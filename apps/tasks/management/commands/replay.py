"""``python manage.py replay TASK_ID`` / ``replay --all``: rebuild state from snapshot + events,
compare with the task row, exit non-zero naming the first divergent event when they differ.

It also audits each task's action rows against the replayed state
(:func:`apps.actions.audit.task_actions_audit`); with ``--remote`` it asks the ticket system, by
idempotency key, whether every recorded outcome is true there as well."""

import uuid

from django.core.management.base import BaseCommand, CommandError

from apps.actions.audit import task_actions_audit
from apps.core import tool_errors as errors
from apps.tasks.models import Task
from apps.tasks.replay import task_replay


class Command(BaseCommand):
    help = "Replay task events and compare with the materialized state."

    def add_arguments(self, parser):
        parser.add_argument("task_id", nargs="?")
        parser.add_argument("--all", action="store_true")
        parser.add_argument("--no-snapshot", action="store_true", help="replay from the first event")
        parser.add_argument("--remote", action="store_true",
                            help="also check every settled action against the ticket system, by its key")

    def handle(self, *args, task_id=None, all=False, no_snapshot=False, remote=False, **options):  # noqa: A002
        if bool(task_id) == bool(all):
            raise CommandError("give a TASK_ID or --all")
        if task_id:
            try:
                uuid.UUID(task_id)
            except ValueError as exc:
                raise CommandError(f"{task_id!r} is not a task id (a UUID)") from exc
        qs = Task.objects.all().order_by("created_at") if all else Task.objects.filter(pk=task_id)
        if not all and not qs.exists():
            raise CommandError(f"no task {task_id}")
        bad = bad_actions = count = purged = 0
        for task in qs.iterator():
            count += 1
            r = task_replay(task, use_snapshot=not no_snapshot)
            if r.ok and r.purged:
                purged += 1
                if not all:
                    self.stdout.write(f"PURGED {r.task_id}: {r.detail} ({r.events} events)")
            elif r.ok:
                if not all:
                    self.stdout.write(f"OK {r.task_id}: {r.events} events replayed"
                                      + (f" after snapshot {r.from_snapshot}" if r.from_snapshot else ""))
            else:
                bad += 1
                self.stdout.write(f"DIVERGED {r.task_id}: first divergent event seq {r.divergent_seq}: {r.detail}")
            try:
                problems = task_actions_audit(task, remote=remote)
            except errors.ToolError as exc:
                raise CommandError(f"the ticket system could not be asked: {exc.detail}") from exc
            for problem in problems:
                self.stdout.write(f"ACTIONS {task.pk}: {problem}")
            bad_actions += bool(problems)
        if all:
            self.stdout.write(f"{count - bad - purged} of {count} tasks replay to their materialized state"
                              + (f"; {purged} purged by retention (event skeleton checked)" if purged else ""))
            where = "their state and the ticket system" if remote else "their state"
            self.stdout.write(f"{count - bad_actions} of {count} tasks have action records that agree with {where}")
        if bad or bad_actions:
            raise CommandError(f"{bad} task(s) diverge, {bad_actions} task(s) with disagreeing action records")
