"""``python manage.py ingest PATH --scope SCOPE [--tenant SLUG]``: ingest a directory of
``.md``/``.txt``/``.html``/``.pdf`` files into the knowledge base with progress output.
``python manage.py ingest --retire SOURCE [--tenant SLUG]`` retires one document."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from apps.accounts.models import AccessScope, Tenant
from apps.evidence.models import Document
from apps.evidence.services import document_retire, path_ingest


class Command(BaseCommand):
    help = "Ingest knowledge documents (.md/.txt/.html/.pdf) under PATH with one access scope, or retire one."

    def add_arguments(self, parser):
        parser.add_argument("path", nargs="?")
        parser.add_argument("--scope", choices=AccessScope.values)
        parser.add_argument("--tenant", default="acme", help="tenant slug (default: acme)")
        parser.add_argument("--retire", metavar="SOURCE", help="retire the document with this source name")

    def handle(self, *args, path, scope, tenant, retire=None, **options):
        t = Tenant.objects.filter(slug=tenant).first()
        if t is None:
            raise CommandError(f"no tenant {tenant!r}; run `python -m tools.seed_demo` or create it first")
        if retire:
            try:
                document_retire(tenant=t, source=retire)
            except Document.DoesNotExist:
                raise CommandError(f"tenant {tenant} has no document {retire!r}") from None
            self.stdout.write(self.style.SUCCESS(f"retired {retire}: its chunks are no longer retrieved"))
            return
        if not path or not scope:
            raise CommandError("give PATH and --scope (or --retire SOURCE)")
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
