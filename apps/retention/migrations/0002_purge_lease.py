"""The purge lease: one row saying which purge run holds the purge until when (apps/retention/purge.py)."""

from django.db import migrations

CREATE = """CREATE TABLE retention_purge_lease (
    id smallint PRIMARY KEY CHECK (id = 1),
    holder varchar(64) NOT NULL,
    expires_at timestamptz NOT NULL
);"""


class Migration(migrations.Migration):
    dependencies = [("retention", "0001_initial")]

    operations = [migrations.RunSQL(CREATE, "DROP TABLE IF EXISTS retention_purge_lease;")]
