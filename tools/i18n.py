"""The translation catalogues: ``python -m tools.i18n compile`` (run by ``make install``, ``make
test``, ``make demo`` and ``make up``) turns each ``config/locale/<lang>/LC_MESSAGES/*.po`` into the
``.mo`` Django reads, with polib — no system gettext needed. ``python -m tools.i18n extract``
(``make messages``) re-reads the templates and the code for marked strings into the catalogues
(Django's ``makemessages``, which needs GNU gettext's ``xgettext``); translate the new entries in
``config/locale/zh_Hans/LC_MESSAGES/django.po`` afterwards.

The ``.mo`` files are build output (ignored by git): the ``.po`` files are the source."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
LOCALE_DIR = BASE_DIR / "config" / "locale"
#: the catalogues (directory names): English, the source language (its entries stay empty: the
#: source text is shown), and Chinese
LOCALES = ("en", "zh_Hans")
#: what ``extract`` does not read: the virtualenv, run-time files, everything that is not the product
EXTRACT_IGNORE = (".venv/*", "var/*", "tools/*", "tests/*", "docs/*", "static/*", "*/tests/*", "build/*")


def compile_catalogues(*, force: bool = False, locale_dir: Path = LOCALE_DIR) -> list[Path]:
    """Write the ``.mo`` of every ``.po`` under ``locale_dir`` (default :data:`LOCALE_DIR`; an
    installed build's copy: deploy/image/build.sh) that is missing or older than its ``.po`` (all
    of them with ``force``); returns the ``.mo`` paths written. Fuzzy entries are left out, as
    ``msgfmt`` does. Raises ``OSError``/``ValueError`` (polib) on an unreadable catalogue, and
    ``FileNotFoundError`` when ``locale_dir`` holds no catalogue at all."""
    import polib

    written = []
    catalogues = sorted(locale_dir.glob("*/LC_MESSAGES/*.po"))
    if not catalogues:
        raise FileNotFoundError(f"no catalogue (*/LC_MESSAGES/*.po) under {locale_dir}")
    for po_path in catalogues:
        mo_path = po_path.with_suffix(".mo")
        if not force and mo_path.exists() and mo_path.stat().st_mtime >= po_path.stat().st_mtime:
            continue
        catalogue = polib.pofile(str(po_path))
        for entry in catalogue.fuzzy_entries():
            catalogue.remove(entry)
        tmp = mo_path.with_suffix(".mo.tmp")
        catalogue.save_as_mofile(str(tmp))
        tmp.replace(mo_path)
        written.append(mo_path)
    return written


def extract() -> None:
    """Django's ``makemessages`` for :data:`LOCALES` over the product's templates and code."""
    import os

    import django
    from django.core.management import call_command

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    sys.path.insert(0, str(BASE_DIR))
    django.setup()
    os.chdir(BASE_DIR)
    call_command("makemessages", locale=list(LOCALES), ignore_patterns=list(EXTRACT_IGNORE), no_obsolete=True,
                 add_location="file", verbosity=1)


def msgids(paths: list[str]) -> list[str]:
    """The msgids ``makemessages`` extracts from ``paths`` (templates and Python files of the
    product, relative to the repository), in a scratch copy, without touching the catalogues."""
    import os
    import shutil
    import tempfile

    import django
    import polib
    from django.core.management import call_command
    from django.test.utils import override_settings

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    sys.path.insert(0, str(BASE_DIR))
    django.setup()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel in paths:
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(BASE_DIR / rel, target)
        (root / "locale").mkdir()
        try:
            os.chdir(root)
            with override_settings(LOCALE_PATHS=[str(root / "locale")]):
                call_command("makemessages", locale=["zh_Hans"], verbosity=0)
        finally:
            os.chdir(here)
        po = root / "locale" / "zh_Hans" / "LC_MESSAGES" / "django.po"
        return [e.msgid for e in polib.pofile(str(po))] if po.exists() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.i18n", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["compile", "extract", "msgids"])
    parser.add_argument("paths", nargs="*", help="msgids: the files to read")
    parser.add_argument("--force", action="store_true", help="compile every catalogue, stale or not")
    parser.add_argument("--locale-dir", type=Path, default=LOCALE_DIR,
                        help="compile: the catalogues under this directory (default: the checkout's config/locale)")
    args = parser.parse_args(argv)
    if args.command == "compile":
        try:
            written = compile_catalogues(force=args.force, locale_dir=args.locale_dir)
        except FileNotFoundError as exc:
            parser.exit(2, f"python -m tools.i18n compile: {exc}\n")
        for path in written:
            print(f"compiled {path.relative_to(BASE_DIR) if path.is_relative_to(BASE_DIR) else path}")
    elif args.command == "msgids":
        import json

        print(json.dumps(msgids(args.paths), ensure_ascii=False, indent=1))
    else:
        extract()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
