"""The agent runtime (DESIGN.md §1 steps 2–6, §5; spec algorithm 16.1 steps 1–3): the step table
that drives a task from its recorded state, the context read, drafting, authorization, the intent
and compensation, the lease sweeper and their Celery tasks. It owns no rows: each write goes
through the service of the app that owns the row."""
