"""``python manage.py ingest PATH --scope SCOPE [--tenant SLUG]``: ingest a directory of
``.md``/``.txt``/``.html`` files into the knowledge base with progress output."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from apps.accounts.models import AccessScope, Tenant
from apps.evidence.services import path_ingest


class Command(BaseCommand):
    help = "Ingest knowledge documents (.md/.txt/.html) under PATH with one access scope."

    def add_arguments(self, parser):
        parser.add_argument("path")
        parser.add_argument("--scope", required=True, choices=AccessScope.values)
        parser.add_argument("--tenant", default="acme", help="tenant slug (default: acme)")

    def handle(self, *args, path, scope, tenant, **options):
        t = Tenant.objects.filter(slug=tenant).first()
        if t is None:
            raise CommandError(f"no tenant {tenant!r}; run `python manage.py seed_demo` or create it first")
        root = Path(path)
        if not root.exists():
            raise CommandError(f"{root} does not exist")

        def progress(i, n, source, outcome):
            self.stdout.write(f"[{i}/{n}] {outcome:9s} {source}")

        report = path_ingest(tenant=t, path=root, scope=scope, progress=progress)
        self.stdout.write(
            self.style.SUCCESS(
                f"ingested {root} as {scope}: {report.created} created, {report.updated} updated, "
                f"{report.unchanged} unchanged, {report.failed} unreadable, {report.chunks_embedded} chunks embedded"
            )
        )
