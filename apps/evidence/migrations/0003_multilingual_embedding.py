"""The default embedding becomes multilingual (use-multilingual-v3, 512 dimensions): the vector
column widens to 512 (shorter embeddings are zero-padded) and records the model that made each
vector. Existing vectors were made by all-MiniLM-L6-v2: they are kept, padded, and marked as that
model's, so nothing is lost; `manage.py reembed` re-embeds them with the configured model."""

import pgvector.django.indexes
import pgvector.django.vector
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("evidence", "0002_governance_metadata")]

    operations = [
        migrations.RemoveIndex(model_name="chunk", name="chunk_embedding_hnsw"),
        migrations.AddField(
            model_name="chunk", name="embedding_model",
            field=models.CharField(default="use-multilingual-v3", max_length=200),
        ),
        migrations.RunSQL(
            sql=[
                "UPDATE evidence_chunk SET embedding_model = 'all-MiniLM-L6-v2'",
                "ALTER TABLE evidence_chunk ALTER COLUMN embedding DROP NOT NULL",
                "ALTER TABLE evidence_chunk ALTER COLUMN embedding TYPE vector(512) USING "
                "(embedding::real[] || array_fill(0::real, ARRAY[512 - vector_dims(embedding)]))::vector(512)",
            ],
            reverse_sql=migrations.RunSQL.noop,
            state_operations=[
                migrations.AlterField(
                    model_name="chunk", name="embedding",
                    field=pgvector.django.vector.VectorField(dimensions=512, null=True),
                ),
            ],
        ),
        migrations.AddIndex(
            model_name="chunk",
            index=pgvector.django.indexes.HnswIndex(
                ef_construction=64, fields=["embedding"], m=16, name="chunk_embedding_hnsw",
                opclasses=["vector_cosine_ops"]),
        ),
    ]
