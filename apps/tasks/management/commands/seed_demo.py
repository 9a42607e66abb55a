"""``python manage.py seed_demo [--no-kb] [--credentials PATH]``: demo tenants, users (passwords
printed and kept in ``var/demo-credentials.json``, or PATH), device fleet and the knowledge base
(ingested per scope folder)."""

from pathlib import Path

from django.core.management.base import BaseCommand

from apps.accounts.models import AccessScope, Tenant
from apps.evidence.corpus import KB_DIR
from apps.evidence.services import document_ingest, path_ingest
from apps.tasks.demo_data import INITECH_KB, demo_seed
from config.env import VAR_DIR

GLOBEX_KB = ("laser-printer-paper-jam.md", "mfp-toner-and-drum-replacement.md", "mfp-scan-to-email-failure.md")


class Command(BaseCommand):
    help = "Seed the demo tenant, users, devices and knowledge base."

    def add_arguments(self, parser):
        parser.add_argument("--no-kb", action="store_true", help="skip knowledge-base ingestion")
        parser.add_argument("--credentials", type=Path, default=VAR_DIR / "demo-credentials.json",
                            help="where the demo users' passwords are kept (default: var/demo-credentials.json)")

    def handle(self, *args, no_kb=False, credentials=None, **options):
        creds = demo_seed(credentials_path=credentials or VAR_DIR / "demo-credentials.json")
        self.stdout.write("Demo users (tenant acme; gus is in tenant globex; ines, ivan and iris in tenant "
                          "initech, whose tickets go to django-helpdesk):")
        for username, password in creds.items():
            self.stdout.write(f"  {username:6s} password: {password}")
        if no_kb:
            return
        acme = Tenant.objects.get(slug="acme")
        for scope in AccessScope.values:
            report = path_ingest(
                tenant=acme, path=KB_DIR / scope, scope=scope,
                progress=lambda i, n, src, outcome: self.stdout.write(f"  [{i}/{n}] {outcome:9s} {src}"),
            )
            self.stdout.write(
                f"knowledge base {scope}: {report.created} created, {report.updated} updated, "
                f"{report.unchanged} unchanged, {report.chunks_embedded} chunks embedded"
            )
        # globex gets its own small copy of the public printer procedures (tenants share nothing).
        globex = Tenant.objects.get(slug="globex")
        for name in GLOBEX_KB:
            document_ingest(tenant=globex, source=f"public/{name}", raw=(KB_DIR / "public" / name).read_text(),
                            scope=AccessScope.PUBLIC)
        self.stdout.write(f"knowledge base globex: {len(GLOBEX_KB)} public printer documents")
        initech = Tenant.objects.get(slug="initech")
        for scope, name in INITECH_KB:
            document_ingest(tenant=initech, source=f"{scope}/{name}", raw=(KB_DIR / scope / name).read_text(),
                            scope=scope)
        self.stdout.write(f"knowledge base initech: {len(INITECH_KB)} printer documents")
