"""``manage.py purge``: one retention purge run now (what beat runs every
``FAULTDESK_PURGE_EVERY_SECONDS``), printing what it purged per table."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.retention.purge import key_window_days, policy_days, purge_run


class Command(BaseCommand):
    help = "Purge what each tenant's retention policy no longer keeps (batched; stops at its time budget)."

    def add_arguments(self, parser):
        parser.add_argument("--time-budget", type=float, default=None,
                            help="seconds the run may take (default FAULTDESK_PURGE_TIME_BUDGET_SECONDS)")
        parser.add_argument("--batch", type=int, default=None, help="rows per batch (default FAULTDESK_PURGE_BATCH)")
        parser.add_argument("--until-done", action="store_true",
                            help="run again until a run reaches the end of what is eligible")

    def handle(self, *args, **opts):
        if opts["batch"] is not None and opts["batch"] < 1:
            raise CommandError("--batch must be 1 or more")
        if opts["time_budget"] is not None and opts["time_budget"] <= 0:
            raise CommandError("--time-budget must be more than 0 seconds")
        self.stdout.write(f"defaults (days): {policy_days(None)}; idempotency window {key_window_days():.1f} days")
        while True:
            run = purge_run(time_budget_seconds=opts["time_budget"], batch_size=opts["batch"])
            if run is None:
                raise CommandError("another purge run holds the lock; try again when it has finished")
            seconds = (run.finished_at - run.started_at).total_seconds()
            self.stdout.write(f"purge run {'complete' if run.complete else 'stopped at its budget'} in {seconds:.1f} s:"
                              f" tasks {run.tasks}" + (f", skipped batches {run.skipped}" if run.skipped else ""))
            for table, c in run.tables.items():
                self.stdout.write(f"  {table:28s} {c['rows']:>9,} rows {c['bytes']:>14,} bytes")
            if run.complete or not opts["until_done"]:
                return
