"""Idempotent setup of everything the REST API cannot create.

The helpdesk API has no Queue, CustomField or token endpoints, so this makes:
  * the Site row's domain (used in e-mail links),
  * the queue(s) faultdesk files into,
  * the custom field(s) faultdesk sets (faultdesk_key, ...),
  * a staff service user + DRF token (printed on stdout, or taken from --token).

  python manage.py hd_bootstrap --queue faults:"Device faults" \
      --custom-field faultdesk_key:varchar:64 --user faultdesk --token <40 hex>
"""
from django.contrib.auth import get_user_model
from django.contrib.sites.models import Site
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from helpdesk.models import CustomField, Queue
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Create queue(s), custom field(s) and a staff API user with a token (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("--site-domain", default="127.0.0.1:8100")
        parser.add_argument("--queue", action="append", default=[],
                            help="slug:Title  (repeatable)")
        parser.add_argument("--custom-field", action="append", default=[],
                            help="name:data_type[:max_length]  (repeatable)")
        parser.add_argument("--unique-field", action="append", default=[],
                            help="custom field name whose value must be unique (partial unique index)")
        parser.add_argument("--user", default="faultdesk")
        parser.add_argument("--password", default=None)
        parser.add_argument("--token", default=None,
                            help="fix the token key (40 chars) instead of generating one")

    @transaction.atomic
    def handle(self, *args, **o):
        Site.objects.update_or_create(pk=1, defaults={"domain": o["site_domain"], "name": "helpdesk"})

        for spec in o["queue"]:
            slug, _, title = spec.partition(":")
            q, created = Queue.objects.get_or_create(slug=slug, defaults={"title": title or slug})
            self.stderr.write(f"queue {q.slug} id={q.id} {'created' if created else 'exists'}")

        for spec in o["custom_field"]:
            parts = spec.split(":")
            name, dtype = parts[0], (parts[1] if len(parts) > 1 else "varchar")
            max_length = int(parts[2]) if len(parts) > 2 else None
            cf, created = CustomField.objects.get_or_create(
                name=name,
                defaults={"label": name[:30], "data_type": dtype, "max_length": max_length,
                          "staff_only": True, "required": False},
            )
            self.stderr.write(f"custom field {cf.name} id={cf.id} {'created' if created else 'exists'}")

        for name in o["unique_field"]:
            cf = CustomField.objects.filter(name=name).first()
            if cf is None:
                raise CommandError(f"--unique-field {name}: no such custom field")
            with connection.cursor() as cur:  # partial index: SQLite and PostgreSQL both support it
                # value <> '': helpdesk's TicketForm stores "" for every custom field
                # a create did not set, so "" must stay repeatable.
                cur.execute(f"DROP INDEX IF EXISTS faultdesk_cfv_unique_{cf.id}")
                cur.execute(
                    f"CREATE UNIQUE INDEX IF NOT EXISTS faultdesk_cfv_unique_{cf.id}_nonempty "
                    f"ON helpdesk_ticketcustomfieldvalue (value) "
                    f"WHERE field_id = {int(cf.id)} AND value IS NOT NULL AND value <> ''"
                )
            self.stderr.write(f"unique index on custom field {name}")

        User = get_user_model()
        user, created = User.objects.get_or_create(username=o["user"], defaults={"is_staff": True})
        if not user.is_staff:
            user.is_staff = True
        if o["password"]:
            user.set_password(o["password"])
        elif created:
            user.set_unusable_password()
        user.save()
        if o["token"]:
            Token.objects.filter(user=user).exclude(key=o["token"]).delete()
            token, _ = Token.objects.get_or_create(user=user, key=o["token"])
        else:
            token, _ = Token.objects.get_or_create(user=user)
        self.stderr.write(f"user {user.username} id={user.id} staff={user.is_staff}")
        self.stdout.write(token.key)
