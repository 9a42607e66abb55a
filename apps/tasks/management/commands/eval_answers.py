"""``python manage.py eval_answers``: the composed answer to every labelled report
(apps.evidence.eval/reports_*.json), checked as the requester would read it
(:mod:`apps.tasks.answer_eval`): citation faithfulness and whole-word cuts over every quoted span,
steps and the alert code's own line in the answered reports, the answer's language, and clean
abstentions. ``--show ID`` prints one report's answer; ``--fail-under`` exits non-zero when
faithfulness is below it (default 1.0: every quoted span must be exact)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.evidence.corpus import KB_DIR
from apps.evidence.evaluation import eval_tenant, reports_load
from apps.tasks.answer_eval import answers_evaluate


class Command(BaseCommand):
    help = "Compose the answer to each labelled report and check what the requester reads."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", default="eval",
                            help="tenant whose corpus answers (default: 'eval', created and ingested when missing)")
        parser.add_argument("--show", action="append", default=[], metavar="ID",
                            help="also print the answer to this labelled report (repeatable)")
        parser.add_argument("--fail-under", type=float, default=1.0,
                            help="exit non-zero when citation faithfulness is below this share (default 1.0)")

    def handle(self, *args, tenant, show, fail_under, **options):
        t = eval_tenant(tenant, kb_dir=KB_DIR, write=self.stdout.write)
        items = reports_load()
        unknown = sorted(set(show) - {i["id"] for i in items})
        if unknown:
            raise CommandError(f"no labelled report {', '.join(unknown)}")
        checks, totals = answers_evaluate(tenant_id=t.pk, items=items)
        self.stdout.write(f"{len(checks)} composed answers, tenant {t.slug}")
        for key, value in totals.items():
            self.stdout.write(f"{key:24s} {value:.4f}" if isinstance(value, float) else f"{key:24s} {value}")
        for c in checks:
            if c.id in show:
                self.stdout.write(f"\n--- {c.id} [{c.group}] {c.outcome}\n{c.text}")
        bad = [c.id for c in checks if c.faithful < c.quotes]
        if bad:
            self.stdout.write(f"unfaithful quotes in: {', '.join(bad[:20])}")
        if not totals["faithfulness"] >= fail_under and totals["quotes"]:
            raise CommandError(f"citation faithfulness {totals['faithfulness']} is below {fail_under}")
