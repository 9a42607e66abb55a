"""``manage.py replay_trajectories --bundle NEW``: the release gate of spec §16.11 — re-drive recorded
tasks through a candidate artifact bundle and fail on any divergence in a decision field, and on any
task it could not re-drive (apps/agent/trajectories.py).

Tasks whose recorded inputs retention purged are listed as "not checked" and counted apart
(``purged_tasks=N``): they are neither tasks without a decision point nor unreplayable ones.

Exit status: 0 when every decision point was re-driven and decided the same (purged tasks among the
selection do not change that: they are named and counted); 1 on a divergence, on a task or point
that is not replayable, when no decision point was re-driven at all — the message says why: no task
selected, every task selected purged by retention, or the tasks left had no decision point — or on
a bad argument or a candidate this build cannot run; 2 when the recorded replies cannot judge the
candidate (a new model without ``--live``, a new embedding model)."""

from __future__ import annotations

import json
import uuid

from django.core.management.base import BaseCommand, CommandError

from apps.accounts.models import Tenant
from apps.agent.trajectories import (
    DECISION_FIELDS,
    BundleInvalid,
    NotJudgeable,
    trajectories_replay,
)
from apps.tasks.models import Task
from apps.tasks.services import artifact_bundle_current

#: bundle parts that are whole numbers: ``key=value`` gives text, converted when it is one
_INT_PARTS = ("max_output_tokens", "units_per_1k_tokens")


def parse_bundle(text: str) -> dict:
    """The candidate bundle's overrides from ``--bundle``: ``pinned`` (none: each task's own bundle),
    ``current`` (this build's bundle for new tasks, with the model settings in force), a JSON object,
    ``@file.json``, or ``key=value`` pairs
    separated by commas (``prompt_template=ticket-draft/2,controller=controller/1``; a whole number
    given for ``max_output_tokens`` or ``units_per_1k_tokens`` is taken as one). Raises
    :class:`CommandError` for anything else. The parts and their values are checked by
    :func:`apps.agent.trajectories.candidate_check`."""
    text = (text or "").strip()
    if text == "pinned":
        return {}  # each task's own bundle: the recorded decisions must come out the same
    if text == "current":
        bundle = artifact_bundle_current()
        bundle.pop("reducer", None)  # a task is always replayed with the reducer it was pinned to
        return bundle
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise CommandError(f"--bundle {text}: {exc}") from exc
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--bundle is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise CommandError("--bundle JSON must be an object")
        return value
    pairs = [p for p in text.split(",") if p.strip()]
    if not pairs or not all("=" in p for p in pairs):
        raise CommandError("--bundle: give 'current', a JSON object, @file.json or key=value[,key=value]")
    out = {k.strip(): v.strip() for k, v in (p.split("=", 1) for p in pairs)}
    for part in _INT_PARTS:
        if part in out and out[part].isdigit():
            out[part] = int(out[part])
    return out


def _nothing_checked(totals) -> str:
    """Why a run that re-drove no decision point checked nothing, for its exit message."""
    if not totals.tasks:
        return "no task was selected: the gate checked nothing"
    if totals.purged_tasks == totals.tasks:
        return (f"no decision point was re-driven: all {totals.tasks} task(s) selected were purged by retention "
                "(their recorded inputs are gone): the gate checked nothing; select tasks still inside the "
                "excerpt and payload retention")
    why = f"{totals.tasks} task(s) selected"
    if totals.purged_tasks:
        why += f": {totals.purged_tasks} purged by retention, {totals.no_point_tasks} without a decision point"
    return f"no decision point was re-driven ({why}): the gate checked nothing"


class Command(BaseCommand):
    help = ("Re-drive recorded tasks' inputs through a candidate artifact bundle and print where its decisions "
            f"({', '.join(DECISION_FIELDS)}) diverge; exits 1 on any divergence in a decision field, any task "
            "it could not re-drive, or when it re-drove no decision point at all (saying why: e.g. every task "
            "selected was purged by retention), 2 when only --live can judge the candidate. Purged tasks are "
            "counted apart (purged_tasks).")

    def add_arguments(self, parser):
        parser.add_argument("--bundle", required=True,
                            help="the candidate: 'pinned', 'current', a JSON object, @file.json or "
                                 "key=value[,key=value] overriding each task's pinned bundle "
                                 "(e.g. prompt_template=ticket-draft/2)")
        parser.add_argument("--live", action="store_true",
                            help="ask the candidate's model again instead of using the recorded replies")
        parser.add_argument("--tenant", help="only this tenant's tasks (slug)")
        parser.add_argument("--task", action="append", default=[], help="only this task (repeatable)")
        parser.add_argument("--limit", type=int, default=0, help="at most this many tasks, newest first")

    def handle(self, *args, **opts):
        overrides = parse_bundle(opts["bundle"])
        for task_id in opts["task"]:
            try:
                uuid.UUID(str(task_id))
            except ValueError:
                raise CommandError(f"--task {task_id!r} is not a task id (a UUID)") from None
        if opts["limit"] < 0:
            raise CommandError(f"--limit {opts['limit']} must be 0 (no limit) or more")
        if opts["tenant"] and not Tenant.objects.filter(slug=opts["tenant"]).exists():
            raise CommandError(f"--tenant {opts['tenant']!r}: no such tenant")
        tasks = Task.objects.select_related("tenant", "requester").order_by("-created_at")
        if opts["tenant"]:
            tasks = tasks.filter(tenant__slug=opts["tenant"])
        if opts["task"]:
            tasks = tasks.filter(pk__in=opts["task"])
        if opts["limit"]:
            tasks = tasks[: opts["limit"]]
        self.stdout.write(f"candidate bundle: {json.dumps(overrides, sort_keys=True)}"
                          f"{' (live model)' if opts['live'] else ' (recorded model replies)'}")
        try:
            totals = trajectories_replay(tasks.iterator(), overrides, live=opts["live"], out=self.stdout)
        except BundleInvalid as exc:
            raise CommandError(f"the candidate bundle cannot run in this build: {exc}") from exc
        except NotJudgeable as exc:
            raise CommandError(f"not judged: {exc}", returncode=2) from exc
        by_field = ", ".join(f"{f}={totals.by_field.get(f, 0)}" for f in DECISION_FIELDS)
        changes = ", ".join(f"{f}={n}" for f, n in sorted(totals.changes.items())) or "none"
        self.stdout.write(f"replay_trajectories: tasks={totals.tasks} decision_points={totals.points} "
                          f"diverged_tasks={totals.diverged_tasks} diverged_points={totals.diverged_points} "
                          f"({by_field}); not_replayable_tasks={totals.unreplayable_tasks} "
                          f"not_replayable_points={totals.unreplayable_points} "
                          f"no_decision_point_tasks={totals.no_point_tasks} purged_tasks={totals.purged_tasks}; "
                          f"describing changes: {changes}; "
                          f"{totals.seconds:.1f} s")
        failures = []
        if totals.diverged_points:
            failures.append(f"{totals.diverged_points} decision point(s) in {totals.diverged_tasks} task(s) "
                            "diverge under the candidate bundle")
        if totals.unreplayable_tasks:
            failures.append(f"{totals.unreplayable_tasks} task(s) could not be re-driven "
                            f"({totals.unreplayable_points} decision point(s) not replayable): "
                            "the gate has not checked them")
        if not totals.points:
            failures.append(_nothing_checked(totals))
        if failures:
            raise CommandError("; ".join(failures), returncode=1)
