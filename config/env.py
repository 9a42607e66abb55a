"""Environment access for faultdesk (django-environ), and the paths of the embedded defaults.

Everything configurable is read here, once, from the process environment (and an optional
``.env`` file at the repository root). Settings modules import ``env`` and ``BASE_DIR`` from here;
no other module reads the environment directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import environ

#: The tree that holds ``templates/``, ``static/`` and ``config/locale/``: the source checkout, or,
#: for an installed build (deploy/image/build.sh: the code installed into a virtualenv, those files
#: beside it), the directory ``FAULTDESK_HOME`` names.
BASE_DIR: Path = Path(os.environ.get("FAULTDESK_HOME") or Path(__file__).resolve().parent.parent)
#: Run-time data (attachments, mail files, beat's schedule, the embedded servers): ``FAULTDESK_VAR_DIR``,
#: or ``var/`` in :data:`BASE_DIR`. The only directory a running process writes to (docs/deploy.md).
VAR_DIR: Path = Path(os.environ.get("FAULTDESK_VAR_DIR") or BASE_DIR / "var")

env = environ.Env()
#: ``.env`` at the repository root (``make`` writes one for development), or the file ``ENV_FILE``
#: names; ``ENV_FILE=""`` reads none. Values already in the environment win over the file's.
_dotenv = Path(os.environ["ENV_FILE"]) if os.environ.get("ENV_FILE") else BASE_DIR / ".env"
if os.environ.get("ENV_FILE", None) != "" and _dotenv.exists():
    environ.Env.read_env(str(_dotenv))
