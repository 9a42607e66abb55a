"""Environment access for faultdesk (django-environ), and the paths of the embedded defaults.

Everything configurable is read here, once, from the process environment (and an optional
``.env`` file at the repository root). Settings modules import ``env`` and ``BASE_DIR`` from here;
no other module reads the environment directly.
"""

from __future__ import annotations

from pathlib import Path

import environ

BASE_DIR: Path = Path(__file__).resolve().parent.parent
VAR_DIR: Path = BASE_DIR / "var"

env = environ.Env()
_dotenv = BASE_DIR / ".env"
if _dotenv.exists():  # pragma: no cover - developer convenience only
    environ.Env.read_env(str(_dotenv))
