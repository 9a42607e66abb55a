"""Index for the lookup view: helpdesk only indexes (ticket_id, field_id)."""
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("helpdesk", "__latest__")]

    operations = [
        migrations.RunSQL(
            "CREATE INDEX IF NOT EXISTS faultdesk_cfv_field_value "
            "ON helpdesk_ticketcustomfieldvalue (field_id, value)",
            "DROP INDEX IF EXISTS faultdesk_cfv_field_value",
        ),
    ]
