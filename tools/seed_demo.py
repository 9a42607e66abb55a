"""``python -m tools.seed_demo [--no-kb] [--credentials PATH]``: demo tenants, users (passwords
printed and kept in ``var/demo-credentials.json``, or PATH), device fleet and the knowledge base
(ingested per scope folder); see :mod:`tools.demo_data`. Settings as ``manage.py`` picks them
(``DJANGO_SETTINGS_MODULE``, else the one ``.env`` names, else production)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from config.env import VAR_DIR  # reads .env into the environment


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.seed_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-kb", action="store_true", help="skip knowledge-base ingestion")
    parser.add_argument("--credentials", type=Path, default=VAR_DIR / "demo-credentials.json",
                        help="where the demo users' passwords are kept (default: var/demo-credentials.json)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.production")
    import django

    django.setup()
    from tools.demo_data import seed

    seed(credentials_path=args.credentials, kb=not args.no_kb)


if __name__ == "__main__":
    main()
