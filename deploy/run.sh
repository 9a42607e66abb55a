#!/usr/bin/env bash
# faultdesk's one entry script: the image's ENTRYPOINT (/opt/faultdesk/bin/faultdesk), each line of the
# Procfile and each systemd unit run a command of it, so all three start the same processes.
#
#   web                      gunicorn config.wsgi on 0.0.0.0:$PORT (8000); WEB_CONCURRENCY processes (2)
#                            of WEB_THREADS threads (4)
#   worker QUEUE [ARG…]      a Celery worker consuming QUEUE (agent, tools, outbox or maintenance), named
#                            QUEUE@host, WORKER_CONCURRENCY processes (2; maintenance 1); ARGs go to celery
#   beat                     Celery beat (its schedule file in the data directory's run/)
#   migrate                  the deploy checks, then the database migrations (the release step)
#   purge [ARG…]             one retention purge run now (manage.py purge; --until-done repeats it)
#   check                    manage.py check --deploy, failing on warnings too
#   manage ARG…              any other management command
#   healthcheck web          GET /healthz on this host's web (exit 0 on 200)
#   healthcheck worker QUEUE a Celery ping of this host's QUEUE worker (exit 0 when it answers within
#                            HEALTHCHECK_TIMEOUT seconds, 10)
#   healthcheck beat         beat's schedule file was written in the last BEAT_STALE_SECONDS (400; beat
#                            writes it at least every 3 minutes while it ticks)
#   healthcheck              the check of the process this container runs (FAULTDESK_PROCESS_FILE, where
#                            web, worker and beat record themselves: the image's HEALTHCHECK); the one-shot
#                            commands are healthy while they run
#   queues                   the queues a worker can consume, one a line
#
# The settings are production's unless DJANGO_SETTINGS_MODULE says otherwise: every secret and URL
# comes from the environment (deploy/production.env.example names them) and a process with a missing
# one refuses to start, naming it.
set -euo pipefail

QUEUES=(agent tools outbox maintenance)
export DJANGO_SETTINGS_MODULE="${DJANGO_SETTINGS_MODULE:-config.settings.production}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python}"

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
  exit 2
}

known_queue() {
  local q
  for q in "${QUEUES[@]}"; do [ "$q" = "$1" ] && return 0; done
  echo "faultdesk: unknown queue '$1' (one of: ${QUEUES[*]})" >&2
  exit 2
}

# web, worker and beat say what they are for the image's HEALTHCHECK (one process per container)
record_process() {
  if [ -n "${FAULTDESK_PROCESS_FILE:-}" ]; then echo "$*" > "$FAULTDESK_PROCESS_FILE"; fi
}

[ $# -ge 1 ] || usage
command="$1"; shift
case "$command" in
  web)
    record_process web
    exec gunicorn config.wsgi --bind "0.0.0.0:${PORT:-8000}" --workers "${WEB_CONCURRENCY:-2}" \
      --threads "${WEB_THREADS:-4}" --timeout 60 --access-logfile - "$@" ;;
  worker)
    [ $# -ge 1 ] || { echo "faultdesk worker: name the queue (one of: ${QUEUES[*]})" >&2; exit 2; }
    queue="$1"; shift
    known_queue "$queue"
    record_process worker "$queue"
    default_concurrency=2
    [ "$queue" = maintenance ] && default_concurrency=1
    exec celery -A config worker -Q "$queue" -n "$queue@%h" -c "${WORKER_CONCURRENCY:-$default_concurrency}" \
      --loglevel "${LOG_LEVEL:-INFO}" "$@" ;;
  beat)
    run_dir="$("$PYTHON" -c 'from config.env import VAR_DIR; print(VAR_DIR / "run")')"
    mkdir -p "$run_dir"
    record_process beat
    exec celery -A config beat --loglevel "${LOG_LEVEL:-INFO}" --pidfile= "$@" ;;
  migrate)
    "$PYTHON" -m django check --deploy --fail-level ERROR
    exec "$PYTHON" -m django migrate --noinput "$@" ;;
  purge)
    exec "$PYTHON" -m django purge "$@" ;;
  check)
    exec "$PYTHON" -m django check --deploy --fail-level WARNING "$@" ;;
  manage)
    [ $# -ge 1 ] || { echo "faultdesk manage: give the management command" >&2; exit 2; }
    exec "$PYTHON" -m django "$@" ;;
  healthcheck)
    if [ $# -eq 0 ]; then
      recorded=""
      [ -n "${FAULTDESK_PROCESS_FILE:-}" ] && [ -r "$FAULTDESK_PROCESS_FILE" ] && recorded="$(cat "$FAULTDESK_PROCESS_FILE")"
      case "$recorded" in
        web|beat|worker\ *) exec "$0" healthcheck $recorded ;;
        *) exit 0 ;;  # a one-shot command (migrate, purge…): healthy while it runs
      esac
    fi
    case "${1:-}" in
      web)
        exec "$PYTHON" - <<'PY'
import os, sys, urllib.request
# the Host header must be one the site serves (DJANGO_ALLOWED_HOSTS), or Django answers 400
host = (os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost").split(",")[0].strip() or "localhost").lstrip(".")
req = urllib.request.Request(f"http://127.0.0.1:{os.environ.get('PORT', '8000')}/healthz", headers={"Host": host})
try:
    with urllib.request.urlopen(req, timeout=5) as resp:  # noqa: S310 - a fixed loopback URL
        sys.exit(0 if resp.status == 200 else 1)
except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", said on stderr
    print(f"faultdesk healthcheck web: {exc}", file=sys.stderr)
    sys.exit(1)
PY
        ;;
      worker)
        [ $# -ge 2 ] || { echo "faultdesk healthcheck worker: name the queue" >&2; exit 2; }
        known_queue "$2"
        exec celery -A config inspect ping --timeout "${HEALTHCHECK_TIMEOUT:-10}" -d "$2@$(hostname)" ;;
      beat)
        exec "$PYTHON" - <<'PY'
import os, sys, time
from pathlib import Path

from config.env import VAR_DIR  # reads no settings: cheap enough for a probe every minute

schedule = sorted(Path(VAR_DIR, "run").glob("celerybeat-schedule*"), key=lambda p: p.stat().st_mtime)
stale = float(os.environ.get("BEAT_STALE_SECONDS", "400"))
if not schedule:
    sys.exit(f"faultdesk healthcheck beat: no schedule file in {VAR_DIR / 'run'}")
age = time.time() - schedule[-1].stat().st_mtime
if age > stale:
    sys.exit(f"faultdesk healthcheck beat: {schedule[-1]} last written {age:.0f} s ago (more than {stale:.0f})")
PY
        ;;
      *) echo "faultdesk healthcheck: web, beat or worker QUEUE" >&2; exit 2 ;;
    esac ;;
  queues)
    printf '%s\n' "${QUEUES[@]}" ;;
  -h|--help|help)
    usage ;;
  *)
    echo "faultdesk: unknown command '$command' (web, worker QUEUE, beat, migrate, purge, check, manage, healthcheck, queues)" >&2
    exit 2 ;;
esac
