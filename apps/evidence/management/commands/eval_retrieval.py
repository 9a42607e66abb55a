"""``python manage.py eval_retrieval``: recall@5, MRR and nDCG@10 of vector-only, full-text-only
and hybrid retrieval over the labelled question set (apps.evidence.evaluation)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.accounts.models import AccessScope, Tenant
from apps.evidence.evaluation import QUESTIONS, evaluate, questions_load
from apps.evidence.services import path_ingest
from apps.tasks.demo_data import KB_DIR


class Command(BaseCommand):
    help = "Score vector, full-text and hybrid retrieval on the labelled questions (issue 6)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", default="eval",
                            help="tenant whose corpus is scored (default: 'eval', created and ingested "
                                 "from apps/evidence/kb when missing; unchanged documents cost nothing)")
        parser.add_argument("--questions", default=str(QUESTIONS))

    def handle(self, *args, tenant, questions, **options):
        from pathlib import Path

        try:
            items = questions_load(Path(questions))
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read the questions: {exc}") from exc
        t = Tenant.objects.filter(slug=tenant).first()
        if t is None:
            if tenant != "eval":
                raise CommandError(f"no tenant {tenant!r}")
            t = Tenant.objects.create(slug="eval", name="Retrieval evaluation")
        if tenant == "eval":
            for scope in AccessScope.values:
                report = path_ingest(tenant=t, path=KB_DIR / scope, scope=scope)
                self.stdout.write(f"corpus {scope}: {report.created} created, {report.updated} updated, "
                                  f"{report.unchanged} unchanged")
        self.stdout.write(f"{len(items)} questions, tenant {t.slug}")
        self.stdout.write(f"{'method':8s} {'recall@5':>9s} {'MRR':>7s} {'nDCG@10':>8s}")
        for s in evaluate(tenant_id=t.pk, questions=items):
            self.stdout.write(f"{s.method:8s} {s.recall_at_5:9.4f} {s.mrr:7.4f} {s.ndcg_at_10:8.4f}")
