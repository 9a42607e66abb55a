"""The checks of ``deploy/image/build.sh verify PREFIX``: what an image built by build.sh must hold
before it is shipped. Run with the built virtualenv's Python (``PREFIX/venv/bin/python -P``); each
check runs the installed code in a child process with a clean environment (no ``.env``, no
checkout on ``sys.path``, ``HOME`` that does not exist):

* ``deploy-check`` — ``manage.py check --deploy`` (Django's checks and faultdesk's E001–E019) is
  clean, warnings included, with ``deploy/production.env.example`` filled in: every empty value
  generated as a secret, ``${NAME}`` references expanded.
* ``writes`` — the runtime does its work as an unprivileged user (root: uid/gid 65534 through
  ``setpriv``; anyone else: with the prefix made read-only for the run) with the network forbidden:
  the WSGI application starts (its deploy checks pass), the login page renders in English and
  Chinese and faultdesk's own catalogue entries come out translated, a collected static file is
  served, the Celery app finds a task for every routed name, beat's schedule file opens, an
  attachment is stored, Chinese is segmented, and both embedding models (``use-multilingual-v3``,
  the default, and ``all-MiniLM-L6-v2``) load from the files the image holds and embed sensibly (a
  paraphrase, and for the multilingual model a translation, lies closer than an unrelated fault).
  It writes only to the data directory (``FAULTDESK_VAR_DIR``) and ``TMPDIR``. "Network forbidden":
  the Hugging Face libraries are told to stay offline, every socket connection and name lookup in
  the process is refused and remembered — an attempt fails the check even when the library would
  have coped without it — and, when the kernel lets this user make one, the process runs in a
  network namespace with no interface up.
* ``model`` — the embedding part of ``writes`` alone, unsandboxed (for a quick look).

``python verify.py --prefix PREFIX --env-example FILE {model,deploy-check,writes,all}``; exit status 0
when every check named passed, 1 otherwise (the failing check says why on stderr), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: the unprivileged user and group the ``writes`` check runs as when started by root ("nobody")
UNPRIVILEGED_ID = 65534
_LINE = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")
_REF = re.compile(r"\$\{(?P<name>[A-Z][A-Z0-9_]*)\}")


def read_env_example(path: Path) -> dict[str, str]:
    """The ``NAME=value`` lines of an env file (``#`` comments and blank lines skipped), in order.
    Raises ``ValueError`` naming the line for anything else (``export``, quotes around a name,
    a repeated name)."""
    found: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            raise ValueError(f"{path}:{number}: not a NAME=value line: {raw!r}")
        if match["name"] in found:
            raise ValueError(f"{path}:{number}: {match['name']} is set twice")
        found[match["name"]] = match["value"]
    return found


def fill_env(example: dict[str, str]) -> dict[str, str]:
    """``example`` as a deployment would fill it: each empty value a fresh secret
    (``secrets.token_urlsafe(48)``: 64 URL-safe characters), then each ``${NAME}`` replaced by that
    variable's value. Raises ``ValueError`` for a reference to a name the file does not set."""
    filled = {name: value or secrets.token_urlsafe(48) for name, value in example.items()}

    def expand(match: re.Match) -> str:
        if match["name"] not in filled:
            raise ValueError(f"${{{match['name']}}} refers to a variable the env file does not set")
        return filled[match["name"]]

    return {name: _REF.sub(expand, value) for name, value in filled.items()}


def runtime_env(prefix: Path, data: Path, example: Path) -> dict[str, str]:
    """The clean environment a check's child runs in: the filled example, the built tree, the data
    directories, production settings, the Hugging Face libraries offline, nothing of this shell's."""
    return {
        **fill_env(read_env_example(example)),
        "PATH": f"{prefix / 'venv' / 'bin'}:/usr/bin:/bin",
        "HOME": "/nonexistent",
        "LANG": "C.UTF-8",
        "ENV_FILE": "",
        "DJANGO_SETTINGS_MODULE": "config.settings.production",
        "FAULTDESK_HOME": str(prefix / "app"),
        "DJANGO_STATIC_ROOT": str(prefix / "app" / "staticfiles"),
        "FAULTDESK_VAR_DIR": str(data / "var"),
        "TMPDIR": str(data / "tmp"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


# --- what runs in the child processes ------------------------------------------------------------

_attempts: list[str] = []


def _forbid_network() -> None:
    """Refuse every socket connection and name lookup in this process, and remember each attempt."""
    import errno
    import socket

    def refuse(what: str):
        def refused(*args, **kwargs):
            _attempts.append(f"{what}{args[1:2] if what.startswith('socket.') else args[:1]}")
            raise OSError(errno.ENETUNREACH, f"network forbidden by deploy/image/verify.py ({what})")
        return refused

    socket.socket.connect = refuse("socket.connect")
    socket.socket.connect_ex = refuse("socket.connect_ex")
    socket.create_connection = refuse("create_connection")
    socket.getaddrinfo = refuse("getaddrinfo")


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _embed_checks() -> list[str]:
    """Both models embed; a paraphrase (and, for the multilingual model, a translation) lies closer
    than an unrelated fault. Returns the problems found."""
    from apps.evidence.embedding import DIMENSIONS, MINILM_MODEL, USE_MODEL, embed_query, embed_texts

    problems = []
    jam, jam_again, battery = ("The printer is jammed with paper", "Paper is stuck inside the printer",
                               "The UPS battery failed its self-test")
    for model, near in ((USE_MODEL, [jam_again, "打印机卡纸了"]), (MINILM_MODEL, [jam_again])):
        vectors = embed_texts([jam, battery, *near], model=model)
        query = embed_query(jam, model=model)
        if any(len(v) != DIMENSIONS for v in [*vectors, query]):
            problems.append(f"{model}: a vector is not {DIMENSIONS} wide")
            continue
        if abs(_cosine(query, vectors[0]) - 1.0) > 1e-3:
            problems.append(f"{model}: the query's vector is not the text's ({_cosine(query, vectors[0]):.4f})")
        far = _cosine(vectors[0], vectors[1])
        for text, vector in zip(near, vectors[2:], strict=True):
            close = _cosine(vectors[0], vector)
            if close <= far:
                problems.append(f"{model}: {text!r} is no closer to {jam!r} ({close:.3f}) than {battery!r} ({far:.3f})")
        print(f"verify: {model} embeds ({len(vectors[0])} wide; paraphrase {_cosine(vectors[0], vectors[2]):.2f},"
              f" unrelated {far:.2f})")
    return problems


def inner_model() -> int:
    """Child: the models load and embed with the network forbidden."""
    _forbid_network()
    import django

    django.setup()
    problems = _embed_checks()
    if _attempts:
        problems.append(f"the models tried to reach the network: {sorted(set(_attempts))[:5]}")
    for problem in problems:
        print(f"verify model: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _catalogue_checks(prefix: Path) -> list[str]:
    """faultdesk's own Chinese entries (not Django's, which ship compiled) come out translated: the
    build compiled the catalogue and the settings find it under FAULTDESK_HOME."""
    import polib
    from django.utils import translation

    po = prefix / "app" / "config" / "locale" / "zh_Hans" / "LC_MESSAGES" / "django.po"
    entries = [e for e in polib.pofile(str(po)) if e.translated() and not e.msgid_plural and not e.msgctxt
               and not e.obsolete and e.msgstr != e.msgid][:20]
    if not entries:
        return [f"{po} has no translated entry to look up"]
    with translation.override("zh-hans"):
        wrong = [e.msgid for e in entries if translation.gettext(e.msgid) != e.msgstr]
    return [f"{len(wrong)} of {len(entries)} Chinese entries are not translated at run time, e.g. {wrong[0]!r}"
            " (the .mo not compiled, or not under FAULTDESK_HOME)"] if wrong else []


def inner_writes(prefix: Path) -> int:
    """Child, as the unprivileged user: the runtime's work with the network forbidden, writing only
    to its data directories."""
    _forbid_network()
    problems = []
    for tree in (prefix, prefix / "venv", prefix / "app"):
        if os.access(tree, os.W_OK):
            problems.append(f"the check is not sandboxed: {tree} is writable by uid {os.geteuid()}")
    if problems:
        print("\n".join(f"verify writes: {p}" for p in problems), file=sys.stderr)
        return 1

    from django.conf import settings
    from django.core.files.base import ContentFile
    from django.core.files.storage import storages
    from django.test import Client

    import config.wsgi  # noqa: F401 - starts Django and runs the deploy checks a web process runs

    host = settings.ALLOWED_HOSTS[0].lstrip(".")
    pages = {}
    for language in ("en", "zh-hans"):
        resp = Client(HTTP_HOST=host, HTTP_ACCEPT_LANGUAGE=language).get("/login/", secure=True)
        if resp.status_code != 200:
            problems.append(f"/login/ in {language}: {resp.status_code}")
        pages[language] = resp.content.decode()
    if not re.search(r"[\u4e00-\u9fff]", pages.get("zh-hans", "")) or pages.get("en") == pages.get("zh-hans"):
        problems.append("the login page is not in Chinese for Accept-Language: zh-hans")
    problems += _catalogue_checks(prefix)
    static = next((p for p in sorted((prefix / "app" / "static").rglob("*")) if p.is_file()), None)
    if static is None:
        problems.append("no static file to serve")
    else:
        url = "/" + settings.STATIC_URL.strip("/") + "/" + static.relative_to(prefix / "app" / "static").as_posix()
        resp = Client(HTTP_HOST=host).get(url, secure=True)
        body = b"".join(resp.streaming_content) if resp.streaming else resp.content
        if resp.status_code != 200 or body != static.read_bytes():
            problems.append(f"{url}: {resp.status_code} (collected static files not served)")

    from config.celery import app

    app.loader.import_default_modules()
    missing = sorted(set(settings.CELERY_TASK_ROUTES) - set(app.tasks))
    if missing:
        problems.append(f"routed Celery tasks the app does not register: {missing}")
    import shelve

    schedule = Path(settings.CELERY_BEAT_SCHEDULE_FILENAME)
    schedule.parent.mkdir(parents=True, exist_ok=True)  # what `faultdesk beat` does
    with shelve.open(str(schedule)) as db:  # noqa: S301 - beat's own file, written here
        db["verify"] = 1
    name = storages["attachments"].save("verify/attachment.txt", ContentFile(b"fault log\n"))
    storages["attachments"].delete(name)

    import jieba

    jieba.setLogLevel(60)
    if "打印机" not in jieba.lcut("打印机卡纸了"):
        problems.append("jieba did not segment 打印机")
    problems += _embed_checks()
    if _attempts:
        problems.append(f"the runtime tried to reach the network: {sorted(set(_attempts))[:5]}")
    for problem in problems:
        print(f"verify writes: {problem}", file=sys.stderr)
    if not problems:
        print(f"verify: the runtime ran as uid {os.geteuid()} writing only to {os.environ['FAULTDESK_VAR_DIR']}"
              f" and {os.environ['TMPDIR']}")
    return 1 if problems else 0


# --- the parent -------------------------------------------------------------------------------------

def _child(args: list[str], env: dict[str, str], cwd: Path, wrapper: list[str] = ()) -> int:
    cmd = [*wrapper, sys.executable, "-P", str(Path(__file__).resolve()), *args]
    return subprocess.run(cmd, env=env, cwd=cwd, check=False).returncode  # noqa: S603


def _no_network_wrapper() -> list[str]:
    """``unshare --net`` when this user may make a network namespace (root on a host; not inside an
    unprivileged container build), else nothing: the in-process refusal still applies."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "--net", "true"], capture_output=True, check=False).returncode == 0:  # noqa: S603
        return [unshare, "--net"]
    return []


def check_model(prefix: Path, example: Path, data: Path) -> int:
    wrapper = _no_network_wrapper()
    print(f"verify: embedding models offline ({'network namespace + ' if wrapper else ''}sockets refused)")
    return _child(["--prefix", str(prefix), "--inner", "model"], runtime_env(prefix, data, example), data, wrapper)


def check_deploy(prefix: Path, example: Path, data: Path) -> int:
    print("verify: manage.py check --deploy with the filled-in env example")
    cmd = [str(prefix / "venv" / "bin" / "python"), "-P", "-m", "django", "check", "--deploy",
           "--fail-level", "WARNING"]
    return subprocess.run(cmd, env=runtime_env(prefix, data, example), cwd=data, check=False).returncode  # noqa: S603


def check_writes(prefix: Path, example: Path, data: Path) -> int:
    env = runtime_env(prefix, data, example)
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if not setpriv:
            print("verify writes: running as root and no setpriv to drop to an unprivileged user", file=sys.stderr)
            return 1
        for path in [data, *data.rglob("*")]:
            os.chown(path, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        # the built tree stays root's: readable and searchable by anyone, writable by nobody else
        for path in (prefix, prefix / "app", prefix / "venv"):
            path.chmod(0o755)
        wrapper = [*_no_network_wrapper(), setpriv, f"--reuid={UNPRIVILEGED_ID}", f"--regid={UNPRIVILEGED_ID}",
                   "--clear-groups"]
        print(f"verify: the runtime as uid {UNPRIVILEGED_ID}, the built tree read-only to it, "
              f"{'in a network namespace, ' if wrapper[0].endswith('unshare') else ''}sockets refused")
        return _child(["--prefix", str(prefix), "--inner", "writes"], env, data, wrapper)
    # not root: the tree is ours, so it is made read-only for the run and given back afterwards
    trees = [p for p in (prefix / "venv", prefix / "app", prefix) if p.exists()]
    subprocess.run(["chmod", "-R", "a-w", *map(str, trees)], check=True)  # noqa: S603, S607
    try:
        wrapper = _no_network_wrapper()
        print(f"verify: the runtime as uid {os.geteuid()}, the built tree made read-only for the run, "
              f"{'in a network namespace, ' if wrapper else ''}sockets refused")
        return _child(["--prefix", str(prefix), "--inner", "writes"], env, data, wrapper)
    finally:
        subprocess.run(["chmod", "-R", "u+w", *map(str, trees)], check=True)  # noqa: S603, S607


CHECKS = {"model": check_model, "deploy-check": check_deploy, "writes": check_writes}
#: what ``all`` runs (``writes`` includes ``model``'s embeddings, sandboxed)
ALL = ("deploy-check", "writes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verify.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=Path, required=True, help="what build.sh built (venv/, app/, bin/)")
    parser.add_argument("--env-example", type=Path, help="deploy/production.env.example")
    parser.add_argument("--inner", choices=["model", "writes"], help=argparse.SUPPRESS)
    parser.add_argument("check", nargs="?", choices=[*CHECKS, "all"])
    args = parser.parse_args(argv)
    prefix = args.prefix.resolve()
    if args.inner == "model":
        return inner_model()
    if args.inner == "writes":
        return inner_writes(prefix)
    if not args.check or not args.env_example:
        parser.error("give the check to run and --env-example")
    if not (prefix / "venv" / "bin" / "python").exists() or not (prefix / "app").is_dir():
        parser.error(f"{prefix} holds no build (venv/bin/python, app/): run build.sh venv and assets first")
    if not args.env_example.is_file():
        parser.error(f"no env example at {args.env_example}")
    failed = []
    for name in ALL if args.check == "all" else [args.check]:
        with tempfile.TemporaryDirectory(prefix="faultdesk-verify-") as tmp:
            data = Path(tmp)
            os.chmod(data, 0o755)  # noqa: S103 - the unprivileged user must reach its data directories
            for sub in ("var", "tmp"):
                (data / sub).mkdir()
            if CHECKS[name](prefix, args.env_example.resolve(), data) != 0:
                failed.append(name)
    if failed:
        print(f"verify: FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("verify: all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
