"""``python manage.py reembed``: embed every chunk whose vector is missing or was made by another
model than the configured one (``FAULTDESK["EMBEDDING_MODEL"]``), e.g. after changing the model."""

from django.core.management.base import BaseCommand

from apps.evidence.embedding import model_configured
from apps.evidence.services import chunks_reembed


class Command(BaseCommand):
    help = "Re-embed chunks made by another embedding model (or none) with the configured one."

    def add_arguments(self, parser):
        parser.add_argument("--batch", type=int, default=256)

    def handle(self, *args, batch, **options):
        model = model_configured()
        n = chunks_reembed(batch=max(1, batch),
                           progress=lambda done, total: self.stdout.write(f"[{done}/{total}] embedded"))
        self.stdout.write(self.style.SUCCESS(f"{n} chunks embedded with {model}"))
