"""The leaf every app may import and that imports no app (docs/architecture.md): domain errors,
structured tool errors, canonical digests, failpoints, the one enqueue helper (Celery tasks
addressed by name) and the page renderer."""
