"""``python manage.py eval_retrieval``: the labelled report eval (apps.evidence.evaluation) —
recall@1, recall@5 and MRR per group, abstention precision and recall, the answered share of the
answerable reports and the operating point (the relevance thresholds) — then recall@5, MRR and
nDCG@10 of vector-only, full-text-only and hybrid retrieval over the question set. ``--sweep``
also prints the figures at neighbouring operating points (the calibration)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from apps.evidence import relevance
from apps.evidence.corpus import KB_DIR
from apps.evidence.evaluation import (
    QUESTIONS,
    eval_tenant,
    evaluate,
    questions_load,
    report_run,
    report_scores,
    reports_load,
)
from apps.evidence.report_signals import out_of_scope_terms


class Command(BaseCommand):
    help = "Score vector, full-text and hybrid retrieval on the labelled questions."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", default="eval",
                            help="tenant whose corpus is scored (default: 'eval', created and ingested "
                                 "from apps/evidence/kb when missing; unchanged documents cost nothing)")
        parser.add_argument("--questions", default=str(QUESTIONS))
        parser.add_argument("--sweep", action="store_true", help="also score neighbouring operating points")

    def handle(self, *args, tenant, questions, sweep=False, **options):
        from pathlib import Path

        try:
            items = questions_load(Path(questions))
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read the questions: {exc}") from exc
        t = eval_tenant(tenant, kb_dir=KB_DIR, write=self.stdout.write)
        reports = reports_load()
        self._reports(t, reports)
        if sweep:
            self._sweep(t, reports)
        self.stdout.write(f"{len(items)} questions, tenant {t.slug}")
        self.stdout.write(f"{'method':8s} {'recall@5':>9s} {'MRR':>7s} {'nDCG@10':>8s}")
        for s in evaluate(tenant_id=t.pk, questions=items):
            self.stdout.write(f"{s.method:8s} {s.recall_at_5:9.4f} {s.mrr:7.4f} {s.ndcg_at_10:8.4f}")

    def _reports(self, t, reports) -> None:
        outcomes = [report_run(tenant_id=t.pk, item=item) for item in reports]
        rows, totals = report_scores(outcomes)
        self.stdout.write(f"{len(reports)} labelled reports, tenant {t.slug}")
        self.stdout.write(f"{'group':28s} {'n':>4s} {'recall@1':>9s} {'recall@5':>9s} {'MRR':>7s} {'as expected':>12s} "
                          f"{'ranked@5':>9s}")
        for r in rows:
            self.stdout.write(f"{r.group:28s} {r.n:4d} {r.recall_at_1:9.4f} {r.recall_at_5:9.4f} {r.mrr:7.4f} "
                              f"{r.as_expected:12.4f} {r.ranking_recall_at_5:9.4f}")
        for key, value in totals.items():
            self.stdout.write(f"{key:28s} {value:.4f}")
        self.stdout.write(
            f"operating point: min similarity {relevance.MIN_SIMILARITY} (Chinese {relevance.MIN_SIMILARITY_ZH}), "
            f"alert margin {relevance.ALERT_MARGIN}, vague at {relevance.VAGUE_SIMILARITY}, "
            f"withheld margin {relevance.WITHHELD_MARGIN}, full-text vote {relevance.TEXT_WEIGHT}/(rank+"
            f"{relevance.TEXT_OFFSET}), out-of-scope margin {relevance.OUT_OF_SCOPE_MARGIN} "
            f"({len(out_of_scope_terms())} excluded objects)")
        self.stdout.write("recall@1/@5 and MRR count an abstention as a miss; ranked@5 is the right document among "
                          "the first five candidates before the relevance check")

    def _sweep(self, t, reports) -> None:
        keep = (relevance.MIN_SIMILARITY, relevance.MIN_SIMILARITY_ZH, relevance.ALERT_MARGIN)
        self.stdout.write(f"{'min sim':>8s} {'zh':>5s} {'margin':>7s} {'answered':>9s} {'abstained':>10s}")
        try:
            for shift in (-0.06, -0.03, 0.0, 0.03, 0.06):
                for margin in (0.0, 0.04, 0.08):
                    relevance.MIN_SIMILARITY, relevance.MIN_SIMILARITY_ZH = keep[0] + shift, keep[1] + shift
                    relevance.ALERT_MARGIN = margin
                    _, totals = report_scores([report_run(tenant_id=t.pk, item=i) for i in reports])
                    self.stdout.write(f"{relevance.MIN_SIMILARITY:8.2f} {relevance.MIN_SIMILARITY_ZH:5.2f} "
                                      f"{margin:7.2f} {totals['answered_of_answerable']:9.4f} "
                                      f"{totals['abstention_recall']:10.4f}")
        finally:
            relevance.MIN_SIMILARITY, relevance.MIN_SIMILARITY_ZH, relevance.ALERT_MARGIN = keep
