"""Where the knowledge-base corpus lives: the markdown procedures under ``apps/evidence/kb/``, one
folder per access scope (``public``, ``tier2``, ``security``). The retrieval and answer evals
(``manage.py eval_retrieval`` / ``eval_answers``) ingest it, and so do the demo seed, the chaos run
and the bench."""

from pathlib import Path

KB_DIR = Path(__file__).resolve().parent / "kb"
