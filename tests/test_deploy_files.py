"""The deployment files agree with the product and with each other (docs/deploy.md):

* ``compose.yaml`` is valid under the Compose Specification's JSON schema (vendored:
  ``tests/schemas/compose-spec.json``, see ``tests/schemas/README.md`` for where it came from);
* and, what no schema can say: every queue of ``CELERY_TASK_ROUTES`` and every beat-scheduled task's
  queue has a worker service; every long-running service waits for ``migrate`` to complete; every
  command a service, the Dockerfile, the Procfile or a systemd unit gives the image exists in the
  entry script (``deploy/run.sh``), whose queues are exactly the routed ones; no service runs as root;
* ``deploy/production.env.example`` names every variable the production deploy checks demand, is
  refused as it stands (its secrets are empty) and is clean once they are filled in;
* every ``RUN`` of the Dockerfile is a step of ``deploy/image/build.sh`` (the script CI runs on the
  host), its runtime stage is unprivileged, offline for the models, with a healthcheck;
* the systemd units run the Procfile's commands as the unprivileged user, after the release step, and
  ``systemd-analyze verify`` accepts them.

Each semantic check is a function returning its problems, run on the real files and on broken copies:
a check that cannot fail would pass those too.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import jsonschema
import pytest
import yaml
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"
ENV_EXAMPLE = ROOT / "deploy" / "production.env.example"
RUN_SH = ROOT / "deploy" / "run.sh"
BUILD_SH = ROOT / "deploy" / "image" / "build.sh"
DOCKERFILE = ROOT / "Dockerfile"
PROCFILE = ROOT / "Procfile"
SYSTEMD = ROOT / "deploy" / "systemd"
#: where build.sh installs deploy/run.sh (the image's ENTRYPOINT, the systemd units' ExecStart)
INSTALLED_ENTRY = "/opt/faultdesk/bin/faultdesk"
ROOT_USERS = {"root", "0", "0:0"}


def _verify_module():
    spec = importlib.util.spec_from_file_location("deploy_image_verify", ROOT / "deploy" / "image" / "verify.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


verify = _verify_module()


def load_compose(text: str | None = None) -> dict:
    return yaml.safe_load(text if text is not None else COMPOSE.read_text())


# --- what the entry script offers ---------------------------------------------------------------------

def entry_commands(script: str) -> set[str]:
    """The commands of deploy/run.sh: the labels of its top-level ``case "$command"``."""
    body = script.split('case "$command" in', 1)[1]
    return {label for line in body.splitlines() if (m := re.match(r"^  ([a-z|-]+)\)", line))
            for label in m[1].split("|") if not label.startswith("-")}


def entry_queues(script: str) -> list[str]:
    """The queues deploy/run.sh accepts (its ``QUEUES=(…)``)."""
    return re.search(r"^QUEUES=\(([^)]*)\)", script, re.M)[1].split()


def command_problems(where: str, argv: list[str], script: str) -> list[str]:
    """Why ``argv`` (the entry script's arguments) is not a command the entry script runs."""
    if not argv:
        return [f"{where}: no command"]
    if argv[0] not in entry_commands(script):
        return [f"{where}: {argv[0]!r} is not a command of deploy/run.sh"]
    if argv[0] == "worker" and (len(argv) < 2 or argv[1] not in entry_queues(script)):
        return [f"{where}: worker {argv[1:2]} is not a queue of deploy/run.sh"]
    if argv[0] == "healthcheck" and len(argv) > 1 and argv[1] not in ("web", "beat", "worker"):
        return [f"{where}: healthcheck {argv[1]!r} is not one deploy/run.sh knows"]
    return []


# --- compose ------------------------------------------------------------------------------------------

def faultdesk_services(compose: dict) -> dict[str, dict]:
    """The services that run the faultdesk image (built from this Dockerfile's runtime stage)."""
    return {name: svc for name, svc in compose["services"].items()
            if isinstance(svc.get("build"), dict) and svc["build"].get("target") == "runtime"}


def schema_errors(compose: dict) -> list[str]:
    validator = jsonschema.Draft201909Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(compose)]


def worker_queues(compose: dict) -> dict[str, str]:
    """queue → the service consuming it, among services that run without a profile."""
    return {svc["command"][1]: name for name, svc in faultdesk_services(compose).items()
            if not svc.get("profiles") and svc.get("command", [None])[0] == "worker" and len(svc["command"]) > 1}


def queue_problems(compose: dict, routes: dict, beat_schedule: dict, default_queue: str) -> list[str]:
    """Every routed queue, and every beat-scheduled task's queue, has a worker service."""
    consumed = worker_queues(compose)
    problems = [f"queue {q!r} (CELERY_TASK_ROUTES) has no worker service"
                for q in sorted({r["queue"] for r in routes.values()}) if q not in consumed]
    for entry, beat in sorted(beat_schedule.items()):
        queue = routes.get(beat["task"], {}).get("queue", default_queue)
        if queue not in consumed:
            problems.append(f"beat's {entry!r} sends {beat['task']} to queue {queue!r}, which no worker consumes")
    return problems


def migrate_problems(compose: dict) -> list[str]:
    """migrate is a one-shot service; every other faultdesk service waits for it to complete."""
    services = faultdesk_services(compose)
    migrate = services.get("migrate")
    if migrate is None or migrate.get("command") != ["migrate"]:
        return ["no `migrate` service running the entry script's migrate"]
    problems = [] if migrate.get("restart") == "no" else ["migrate restarts: it must run once"]
    for name, svc in services.items():
        if name == "migrate":
            continue
        depends = svc.get("depends_on") or {}
        condition = depends.get("migrate", {}).get("condition") if isinstance(depends, dict) else None
        if condition != "service_completed_successfully":
            problems.append(f"{name} does not wait for migrate to complete (depends_on condition {condition!r})")
    return problems


def root_problems(compose: dict) -> list[str]:
    """Every service names an unprivileged user (every image used here starts as root otherwise)."""
    return [f"{name} runs as root (user {svc.get('user')!r})" for name, svc in compose["services"].items()
            if str(svc.get("user", "root")).split(":")[0] in ("root", "0")]


def compose_command_problems(compose: dict, script: str) -> list[str]:
    problems = []
    for name, svc in faultdesk_services(compose).items():
        problems += command_problems(f"{name} command", svc.get("command") or [], script)
        test = (svc.get("healthcheck") or {}).get("test") or []
        if test[:2] == ["CMD", "faultdesk"]:
            problems += command_problems(f"{name} healthcheck", test[2:], script)
    return problems


def healthcheck_problems(compose: dict) -> list[str]:
    """Every long-running service has a healthcheck (the one-shot migrate has none to give)."""
    return [f"{name} has no healthcheck" for name, svc in compose["services"].items()
            if name != "migrate" and not (svc.get("healthcheck") or {}).get("test")]


def all_compose_problems(compose: dict, script: str) -> list[str]:
    return (schema_errors(compose)
            + queue_problems(compose, settings.CELERY_TASK_ROUTES, settings.CELERY_BEAT_SCHEDULE,
                             settings.CELERY_TASK_DEFAULT_QUEUE)
            + migrate_problems(compose) + root_problems(compose) + compose_command_problems(compose, script)
            + healthcheck_problems(compose))


def test_compose_file_is_valid_under_the_compose_specification_schema():
    assert schema_errors(load_compose()) == []


def test_the_schema_check_rejects_what_compose_would():
    compose = load_compose()
    broken = copy.deepcopy(compose)
    broken["services"]["web"]["depends_on"]["migrate"]["condition"] = "service_finished"
    broken["services"]["beat"]["healthchek"] = {"test": ["CMD", "true"]}
    broken["services"]["worker-agent"]["ports"] = "8000:8000"
    errors = schema_errors(broken)
    assert any(e.startswith("services/web/depends_on") for e in errors), errors
    assert any("healthchek" in e for e in errors), errors
    assert any(e.startswith("services/worker-agent/ports") for e in errors), errors


def test_compose_file_agrees_with_the_product():
    assert all_compose_problems(load_compose(), RUN_SH.read_text()) == []


def test_every_routed_queue_and_every_beat_task_has_a_worker_service():
    queues = {r["queue"] for r in settings.CELERY_TASK_ROUTES.values()}
    assert set(worker_queues(load_compose())) >= queues


@pytest.mark.parametrize("breakage, expected", [
    (lambda c: c["services"].pop("worker-maintenance"), "queue 'maintenance' (CELERY_TASK_ROUTES) has no worker"),
    (lambda c: c["services"]["worker-outbox"].update(profiles=["extra"]), "queue 'outbox'"),
    (lambda c: c["services"]["web"]["depends_on"].pop("migrate"), "web does not wait for migrate"),
    (lambda c: c["services"]["beat"]["depends_on"]["migrate"].update(condition="service_started"),
     "beat does not wait for migrate to complete"),
    (lambda c: c["services"]["migrate"].update(restart="unless-stopped"), "migrate restarts"),
    (lambda c: c["services"]["db"].pop("user"), "db runs as root"),
    (lambda c: c["services"]["worker-tools"].update(user="0:0"), "worker-tools runs as root"),
    (lambda c: c["services"]["worker-agent"].update(command=["wrker", "agent"]), "'wrker' is not a command"),
    (lambda c: c["services"]["worker-agent"].update(command=["worker", "agnt"]), "is not a queue of deploy/run.sh"),
    (lambda c: c["services"]["web"]["healthcheck"].update(test=["CMD", "faultdesk", "healthcheck", "wbe"]),
     "healthcheck 'wbe'"),
    (lambda c: c["services"]["redis"].pop("healthcheck"), "redis has no healthcheck"),
])
def test_each_compose_check_fails_on_a_broken_copy(breakage, expected):
    broken = copy.deepcopy(load_compose())
    breakage(broken)
    problems = all_compose_problems(broken, RUN_SH.read_text())
    assert any(expected in p for p in problems), problems


def test_a_beat_task_routed_to_a_queue_without_worker_is_found():
    routes = {**settings.CELERY_TASK_ROUTES, "purge_expired": {"queue": "archive"}}
    problems = queue_problems(load_compose(), routes, settings.CELERY_BEAT_SCHEDULE, "agent")
    assert any("beat's 'retention-purge' sends purge_expired to queue 'archive'" in p for p in problems), problems


def test_the_entry_scripts_queues_are_the_routed_queues():
    routed = {r["queue"] for r in settings.CELERY_TASK_ROUTES.values()}
    assert sorted(entry_queues(RUN_SH.read_text())) == sorted(routed)


def test_the_entry_script_refuses_an_unknown_command_or_queue():
    for argv, said in ((["worker", "nope"], "unknown queue 'nope'"), (["serve"], "unknown command 'serve'"),
                       (["worker"], "name the queue")):
        done = subprocess.run(["bash", str(RUN_SH), *argv], capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 2 and said in done.stderr, (argv, done.stderr)


# --- the env example ------------------------------------------------------------------------------------

def _deploy_problems(env: dict[str, str]) -> list[str]:
    """The messages of config.deploy_checks.deploy_problems() under production settings with only ``env``."""
    code = ("import json, django; django.setup(); from config.deploy_checks import deploy_problems; "
            "print(json.dumps([p.msg for p in deploy_problems()]))")
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "ENV_FILE": "",
             "DJANGO_SETTINGS_MODULE": "config.settings.production", **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def demanded_variables() -> frozenset[str]:
    """The environment variables the deploy checks name when nothing is set, with either model provider."""
    names = set()
    for provider in ("local", "openai_compatible"):
        for message in _deploy_problems({"FAULTDESK_MODEL_PROVIDER": provider}):
            names |= set(re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b|\bEMAIL_HOST\b", message))
    return frozenset(names)


#: a demanded variable another one stands in for (E006: the broker is CELERY_BROKER_URL, else REDIS_URL)
ALTERNATIVES = {"CELERY_BROKER_URL": "REDIS_URL"}


def missing_from_example(example: dict[str, str], demanded: set[str]) -> list[str]:
    return sorted(name for name in demanded if name not in example and ALTERNATIVES.get(name) not in example)


def test_the_env_example_names_every_variable_the_deploy_checks_demand():
    demanded = demanded_variables()
    # the checks name at least these today; the set is read from them, not from this list
    assert {"DJANGO_SECRET_KEY", "DATABASE_URL", "REFSERVICE_WEBHOOK_SECRET", "FAULTDESK_MODEL_BASE_URL"} <= demanded
    assert missing_from_example(verify.read_env_example(ENV_EXAMPLE), demanded) == []


def test_an_env_example_without_a_demanded_variable_is_found():
    example = verify.read_env_example(ENV_EXAMPLE)
    example.pop("REFSERVICE_API_KEY")
    assert missing_from_example(example, demanded_variables()) == ["REFSERVICE_API_KEY"]


def test_the_env_example_is_refused_as_it_stands_and_clean_filled_in():
    example = verify.read_env_example(ENV_EXAMPLE)
    unfilled = _deploy_problems({k: v for k, v in example.items() if "${" not in v})
    assert any("DJANGO_SECRET_KEY is not set" in p for p in unfilled), unfilled
    assert _deploy_problems(verify.fill_env(example)) == []


def test_the_env_example_reader_refuses_what_it_cannot_read(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("A_B=1\nexport C_D=2\n")
    with pytest.raises(ValueError, match="bad.env:2: not a NAME=value line"):
        verify.read_env_example(bad)
    bad.write_text("A_B=1\nA_B=2\n")
    with pytest.raises(ValueError, match="A_B is set twice"):
        verify.read_env_example(bad)
    with pytest.raises(ValueError, match=r"\$\{NOPE\} refers to a variable"):
        verify.fill_env({"URL": "redis://:${NOPE}@redis"})
    filled = verify.fill_env({"PW": "", "URL": "redis://:${PW}@redis"})
    assert len(filled["PW"]) == 64 and filled["URL"] == f"redis://:{filled['PW']}@redis"


# --- Dockerfile ----------------------------------------------------------------------------------------

def dockerfile_stages(text: str) -> dict[str, list]:
    """stage name → its instructions, read by BuildKit's own parser (the ``dockerfile`` package: a
    Dockerfile Docker could not read raises ``dockerfile.GoParseError``); ``""`` holds what comes
    before the first ``FROM``."""
    stages: dict[str, list] = {"": []}
    current = ""
    for instruction in dockerfile.parse_string(text):
        if instruction.cmd == "FROM":
            current = instruction.value[-1] if len(instruction.value) == 3 else instruction.value[0]
            stages[current] = []
        stages[current].append(instruction)
    return stages


def build_steps(script: str) -> set[str]:
    body = script.split('case "$command" in', 1)[1]
    return {label for m in re.finditer(r"^  ([a-z|]+)\)", body, re.M) for label in m[1].split("|")}


def dockerfile_problems(text: str, run_script: str, build_script: str) -> list[str]:
    stages = dockerfile_stages(text)
    problems = []
    steps = build_steps(build_script)
    for stage, instructions in stages.items():
        for run in (i for i in instructions if i.cmd == "RUN"):
            for part in " ".join(run.value).split("&&"):
                words = part.split()
                if not words or not words[0].endswith("/build.sh"):
                    problems.append(f"{stage}: RUN {part.strip()!r} is not a step of deploy/image/build.sh")
                elif len(words) < 2 or words[1] not in steps:
                    problems.append(f"{stage}: RUN {part.strip()!r}: build.sh has no step {words[1:2]}")
    if list(stages)[-1] != "runtime":
        problems.append("the last stage (the default target) is not `runtime`")
    for shipped in ("runtime", "model"):  # the stages that are images of their own
        users = [i.value[0] for i in stages.get(shipped, []) if i.cmd == "USER"]
        if not users or users[-1].split(":")[0] in ROOT_USERS:
            problems.append(f"the {shipped} stage runs as {(users or ['root'])[-1]!r}")
    runtime = {i.cmd: i for i in stages.get("runtime", [])}
    env = dict(zip(runtime["ENV"].value[::2], runtime["ENV"].value[1::2], strict=True)) if "ENV" in runtime else {}
    if env.get("HF_HUB_OFFLINE") != "1" or env.get("TRANSFORMERS_OFFLINE") != "1":
        problems.append("the runtime stage does not keep the Hugging Face libraries offline (HF_HUB_OFFLINE=1)")
    health = list(runtime["HEALTHCHECK"].value) if "HEALTHCHECK" in runtime else []
    if health[:2] != ["CMD", "faultdesk"]:
        problems.append("the runtime stage has no HEALTHCHECK through the entry script")
    else:
        problems += command_problems("HEALTHCHECK", health[2:], run_script)
    if "ENTRYPOINT" not in runtime or list(runtime["ENTRYPOINT"].value) != ["faultdesk"]:
        problems.append("the runtime stage's ENTRYPOINT is not the entry script")
    problems += command_problems("CMD", list(runtime["CMD"].value) if "CMD" in runtime else [], run_script)
    base = [i.value[0] for i in stages[""] if i.cmd == "ARG"]
    if "PYTHON_IMAGE=python:3.11-slim-bookworm" not in base:
        problems.append("the base image is not python:3.11-slim-bookworm")
    return problems


def test_dockerfile_builds_with_the_script_ci_runs_and_runs_unprivileged():
    assert dockerfile_problems(DOCKERFILE.read_text(), RUN_SH.read_text(), BUILD_SH.read_text()) == []


@pytest.mark.parametrize("old, new, expected", [
    ("RUN deploy/image/build.sh assets /opt/faultdesk", "RUN pip install -r requirements.txt",
     "is not a step of deploy/image/build.sh"),
    ("RUN deploy/image/build.sh assets /opt/faultdesk", "RUN deploy/image/build.sh assest /opt/faultdesk",
     "build.sh has no step ['assest']"),
    ("USER 10001:10001", "USER root", "the model stage runs as 'root'"),
    ("USER 10001:10001\nWORKDIR /var/lib/faultdesk\nVOLUME", "WORKDIR /var/lib/faultdesk\nVOLUME",
     "the runtime stage runs as 'root'"),
    ("    HF_HUB_OFFLINE=1 \\\n", "", "HF_HUB_OFFLINE=1"),
    ('ENTRYPOINT ["faultdesk"]', 'ENTRYPOINT ["gunicorn"]', "ENTRYPOINT is not the entry script"),
    ('CMD ["faultdesk", "healthcheck"]', 'CMD ["faultdesk", "health"]', "'health' is not a command"),
    ('CMD ["web"]', 'CMD ["serve"]', "'serve' is not a command"),
])
def test_each_dockerfile_check_fails_on_a_broken_copy(old, new, expected):
    text = DOCKERFILE.read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new, 1), RUN_SH.read_text(), BUILD_SH.read_text())
    assert any(expected in p for p in problems), problems


HADOLINT = Path(sys.executable).parent / "hadolint"


def _hadolint(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def test_hadolint_finds_nothing_in_the_dockerfile_and_would_flag_a_root_user(tmp_path):
    done = _hadolint(DOCKERFILE.read_text(), tmp_path)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    flagged = _hadolint(DOCKERFILE.read_text() + "USER root\n", tmp_path)
    assert flagged.returncode != 0 and "DL3002" in flagged.stdout, flagged.stdout


def test_a_dockerfile_docker_could_not_read_is_refused():
    text = DOCKERFILE.read_text()
    assert "\nEXPOSE 8000\n" in text
    with pytest.raises(dockerfile.GoParseError, match="ENV must have two arguments"):
        dockerfile_problems(text.replace("\nEXPOSE 8000\n", "\nENV FAULTDESK_PORT\nEXPOSE 8000\n"),
                            RUN_SH.read_text(), BUILD_SH.read_text())


# --- Procfile and systemd ------------------------------------------------------------------------------

def procfile(text: str) -> dict[str, list[str]]:
    """process name → its command's arguments to the entry script (``deploy/run.sh ARGS``)."""
    found = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, _, command = line.partition(":")
        argv = shlex.split(command)
        assert argv[0] == "deploy/run.sh", f"Procfile {name}: not the entry script: {command}"
        found[name.strip()] = argv[1:]
    return found


def unit_settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


#: Procfile process → the systemd unit (and its instance) running it
UNITS = {"release": ("faultdesk-migrate.service", ""), "web": ("faultdesk-web.service", ""),
         "beat": ("faultdesk-beat.service", ""),
         **{f"worker-{q}": ("faultdesk-worker@.service", q) for q in ("agent", "tools", "outbox", "maintenance")}}


def systemd_problems(units: dict[str, str], processes: dict[str, list[str]]) -> list[str]:
    """The units run each Procfile process's command, as faultdesk, after the release step; the
    target wants each of them."""
    problems = []
    target = " ".join(unit_settings(units.get("faultdesk.target", "")).get("Wants", []))
    for process, argv in processes.items():
        unit, instance = UNITS.get(process, (None, None))
        if unit is None or unit not in units:
            problems.append(f"no systemd unit runs the Procfile's {process}")
            continue
        conf = unit_settings(units[unit])
        start = [w.replace("%i", instance) for w in shlex.split(" ".join(conf.get("ExecStart", [])))]
        if start != [INSTALLED_ENTRY, *argv]:
            problems.append(f"{unit}: ExecStart {start} is not the Procfile's {process}: {[INSTALLED_ENTRY, *argv]}")
        if conf.get("User", ["root"])[-1] in ROOT_USERS:
            problems.append(f"{unit} runs as {conf.get('User', ['root'])[-1]}")
        if process != "release" and "faultdesk-migrate.service" not in " ".join(conf.get("Requires", [])):
            problems.append(f"{unit} does not require the release step (faultdesk-migrate.service)")
        wanted = unit.replace("@.", f"@{instance}.")
        if wanted not in target.split():
            problems.append(f"faultdesk.target does not want {wanted}")
    return problems


def read_units() -> dict[str, str]:
    return {p.name: p.read_text() for p in SYSTEMD.iterdir()}


def test_the_procfile_names_every_process_with_commands_of_the_entry_script():
    processes = procfile(PROCFILE.read_text())
    assert set(processes) == set(UNITS)
    script = RUN_SH.read_text()
    assert [p for name, argv in processes.items() for p in command_problems(f"Procfile {name}", argv, script)] == []
    assert {argv[1] for name, argv in processes.items() if argv[0] == "worker"} == set(entry_queues(script))


def test_the_systemd_units_run_the_procfiles_commands_unprivileged():
    assert systemd_problems(read_units(), procfile(PROCFILE.read_text())) == []


@pytest.mark.parametrize("unit, old, new, expected", [
    ("faultdesk-web.service", "User=faultdesk", "User=root", "faultdesk-web.service runs as root"),
    ("faultdesk-worker@.service", "faultdesk worker %i", "faultdesk worker agent", "ExecStart"),
    ("faultdesk-beat.service", "Requires=faultdesk-migrate.service", "", "does not require the release step"),
    ("faultdesk.target", "faultdesk-worker@outbox.service ", "", "does not want faultdesk-worker@outbox.service"),
])
def test_each_systemd_check_fails_on_a_broken_copy(unit, old, new, expected):
    units = read_units()
    assert old in units[unit]
    units[unit] = units[unit].replace(old, new)
    problems = systemd_problems(units, procfile(PROCFILE.read_text()))
    assert any(expected in p for p in problems), problems


def _analyze(tmp_path: Path, units: dict[str, str]) -> subprocess.CompletedProcess:
    """``systemd-analyze verify`` of ``units`` installed into a scratch root beside the host's own
    unit files and the entry script where build.sh installs it."""
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    entry = root / INSTALLED_ENTRY.lstrip("/")
    entry.parent.mkdir(parents=True)
    shutil.copy(RUN_SH, entry)
    for name, text in units.items():
        (root / "etc/systemd/system" / name).write_text(text)
    names = [n.replace("@.", f"@{q}.") for n in units for q in (["agent", "maintenance"] if "@." in n else [""])]
    return subprocess.run(["systemd-analyze", "verify", f"--root={root}", *names], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.skipif(not shutil.which("systemd-analyze") or not Path("/usr/lib/systemd/system").is_dir(),
                    reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_accepts_the_units_and_would_refuse_a_typo(tmp_path):
    done = _analyze(tmp_path / "good", read_units())
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stderr
    units = read_units()
    units["faultdesk-web.service"] = units["faultdesk-web.service"].replace("Restart=on-failure", "Restrat=on-failure")
    done = _analyze(tmp_path / "typo", units)
    assert "Unknown key 'Restrat'" in done.stderr, done.stderr


# --- the build's own helpers --------------------------------------------------------------------------

def test_catalogues_compile_into_another_tree_and_an_empty_one_is_an_error(tmp_path):
    """build.sh assets compiles the copy of the catalogues beside an installed build."""
    import shutil as sh

    from tools.i18n import LOCALE_DIR, compile_catalogues

    sh.copytree(LOCALE_DIR, tmp_path / "locale", ignore=sh.ignore_patterns("*.mo"))
    written = compile_catalogues(force=True, locale_dir=tmp_path / "locale")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "locale/en/LC_MESSAGES/django.mo", "locale/zh_Hans/LC_MESSAGES/django.mo"]
    with pytest.raises(FileNotFoundError, match="no catalogue"):
        compile_catalogues(locale_dir=tmp_path / "empty")
    done = subprocess.run([sys.executable, "-m", "tools.i18n", "compile", "--locale-dir", str(tmp_path / "empty")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "no catalogue" in done.stderr, done.stderr


def test_the_image_healthcheck_runs_the_check_of_the_recorded_process(tmp_path):
    """`faultdesk healthcheck` with no argument (the image's HEALTHCHECK) checks what the container runs."""
    from tests.procs import free_port

    recorded = tmp_path / "process"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "FAULTDESK_PROCESS_FILE": str(recorded),
           "PORT": str(free_port()), "ENV_FILE": ""}
    recorded.write_text("web\n")  # nothing listens on PORT: unhealthy, and said why
    done = subprocess.run(["bash", str(RUN_SH), "healthcheck"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 1 and "faultdesk healthcheck web:" in done.stderr, done.stderr
    recorded.write_text("worker agnt\n")
    done = subprocess.run(["bash", str(RUN_SH), "healthcheck"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and "unknown queue 'agnt'" in done.stderr, done.stderr
    recorded.unlink()  # a one-shot command (migrate, purge) records nothing: healthy while it runs
    assert subprocess.run(["bash", str(RUN_SH), "healthcheck"], env=env, timeout=60, check=False).returncode == 0


def test_the_build_script_says_what_is_wrong_with_its_input(tmp_path):
    def build(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(BUILD_SH), *argv], capture_output=True, text=True, timeout=60, check=False)

    assert build().returncode == 2
    done = build("frobnicate", str(tmp_path))
    assert done.returncode == 2 and "unknown step 'frobnicate'" in done.stderr, done.stderr
    done = build("venv")
    assert done.returncode == 2 and "give one directory" in done.stderr, done.stderr
    done = build("assets", str(tmp_path / "empty"))
    assert done.returncode == 1 and "run build.sh venv" in done.stderr, done.stderr
    done = build("verify", str(tmp_path / "empty"))
    assert done.returncode == 1 and "run build.sh assets" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "image" / "verify.py"), "--prefix", str(tmp_path),
                           "--env-example", str(ENV_EXAMPLE), "all"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and "holds no build" in done.stderr, done.stderr


# --- what compose makes of the env example: each faultdesk container's environment --------------------
#
# The schema and the checks above read compose.yaml as written; what the containers get is compose.yaml
# interpolated with `--env-file deploy/production.env` and each service's `env_file:` overridden by its
# `environment:`. Compose reads an env file line by line, a `${NAME}` resolved from the lines above it
# (compose-spec/compose-go#793); compose.yaml's `${NAME:-default}` takes the env file's value when it is
# set and not empty.

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def compose_interpolate(text: str, variables: dict[str, str]) -> str:
    """``text`` with compose's ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``${NAME:?error}``,
    ``${NAME?error}``, ``${NAME:+other}``, ``$NAME`` and ``$$`` replaced (defaults may nest). Raises
    ``ValueError`` where compose would stop (a required variable unset or empty)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                if j >= len(text):
                    raise ValueError(f"unclosed ${{ in {text!r}")
                if text.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                depth -= text[j] == "}"
                j += 1
            inner = text[i + 2:j - 1]
            name = _NAME.match(inner)[0]
            op, arg = re.match(r"(:?[-?+]|)(.*)", inner[len(name):], re.S).groups()
            value = variables.get(name)
            if op in (":-", "-"):
                unset = not value if op == ":-" else value is None
                value = compose_interpolate(arg, variables) if unset else value
            elif op in (":?", "?"):
                if (not value) if op == ":?" else value is None:
                    raise ValueError(f"required variable {name} is missing a value: {arg}")
            elif op in (":+", "+"):
                value = compose_interpolate(arg, variables) if (value if op == ":+" else value is not None) else ""
            out.append(value or "")
            i = j
        elif text[i] == "$" and (m := _NAME.match(text, i + 1)):
            out.append(variables.get(m[0], ""))
            i = m.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def compose_env_file(lines: list[str]) -> dict[str, str]:
    """An env file's variables as compose reads them: in order, each value interpolated with the
    variables of the lines above it."""
    found: dict[str, str] = {}
    for raw in lines:
        line = raw.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            found[name] = compose_interpolate(value, found)
    return found


def filled_env_lines(lines: list[str]) -> list[str]:
    """The env example's lines as an operator fills them in: every empty value a fresh secret."""
    import secrets

    return [f"{line}{secrets.token_urlsafe(48)}" if re.fullmatch(r"[A-Z][A-Z0-9_]*=", line.strip()) else line
            for line in lines]


def container_environments(compose_text: str, env_lines: list[str]) -> dict[str, dict[str, str]]:
    """service → the environment compose gives each faultdesk container, with ``env_lines`` both as
    ``--env-file`` and as the services' ``env_file:``."""
    file_vars = compose_env_file(env_lines)
    compose = load_compose(compose_text)
    result = {}
    for name, svc in faultdesk_services(compose).items():
        environment = {k: compose_interpolate(str(v), file_vars) for k, v in (svc.get("environment") or {}).items()}
        result[name] = {**file_vars, **environment}
    return result


def credential_problems(compose_text: str, env_lines: list[str]) -> list[str]:
    """Every URL a faultdesk container is given for compose's own Redis, RabbitMQ or PostgreSQL carries
    the password that service is started with."""
    from urllib.parse import unquote, urlsplit

    file_vars = compose_env_file(env_lines)
    expected = {"redis": file_vars.get("REDIS_PASSWORD"), "rabbitmq": file_vars.get("RABBITMQ_PASSWORD"),
                "db": file_vars.get("POSTGRES_PASSWORD")}
    problems = []
    for service, environment in container_environments(compose_text, env_lines).items():
        for var in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"):
            parts = urlsplit(environment.get(var, ""))
            if parts.hostname in expected and unquote(parts.password or "") != (expected[parts.hostname] or ""):
                problems.append(f"{service}: {var} reaches {parts.hostname} without its password "
                                f"({environment[var]!r})")
    return problems


def test_compose_gives_every_container_the_passwords_its_databases_and_broker_start_with():
    lines = filled_env_lines(ENV_EXAMPLE.read_text().splitlines())
    assert credential_problems(COMPOSE.read_text(), lines) == []


def test_compose_with_the_rabbitmq_profile_gives_the_broker_its_password():
    """The env example's RabbitMQ line, uncommented where it stands, as the example says to."""
    lines = filled_env_lines(ENV_EXAMPLE.read_text().splitlines())
    amqp = [i for i, line in enumerate(lines) if re.match(r"#\s*CELERY_BROKER_URL=amqp://", line)]
    assert len(amqp) == 1, "the env example shows the RabbitMQ broker line, commented out"
    lines[amqp[0]] = lines[amqp[0]].lstrip("# ")
    lines = [line for i, line in enumerate(lines) if i == amqp[0] or not line.startswith("CELERY_BROKER_URL=")]
    environments = container_environments(COMPOSE.read_text(), lines)
    assert {env["CELERY_BROKER_URL"].split("@")[-1] for env in environments.values()} == {"rabbitmq:5672//"}
    assert credential_problems(COMPOSE.read_text(), lines) == []


def test_the_credential_check_finds_a_broker_url_without_the_redis_password():
    lines = filled_env_lines(ENV_EXAMPLE.read_text().splitlines())
    lines = [line for line in lines if not line.startswith("CELERY_BROKER_URL=")] + [
        "CELERY_BROKER_URL=redis://redis:6379/0"]
    problems = credential_problems(COMPOSE.read_text(), lines)
    assert any("worker-agent: CELERY_BROKER_URL reaches redis without its password" in p for p in problems), problems
    with pytest.raises(ValueError, match="required variable REDIS_PASSWORD"):
        compose_interpolate("${REDIS_PASSWORD:?set it}", {"REDIS_PASSWORD": ""})
    assert compose_interpolate("${A:-x${B}y}", {"B": "b"}) == "xby"
    assert compose_interpolate("$${A}", {"A": "a"}) == "${A}"


def test_an_http_destination_listed_for_a_credentialed_tool_is_refused_in_production():
    """The gateway injects a tool's credential into every call to a destination listed for it, so a
    listed destination must be https, as the configured URLs must (E012–E014)."""
    env = verify.fill_env(verify.read_env_example(ENV_EXAMPLE))
    assert _deploy_problems(env) == []
    env["FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE"] = "http://tickets-proxy.example:8080"
    env["FAULTDESK_GATEWAY_ALLOW_MODEL"] = "http://old-model.example:8000/v1"
    problems = _deploy_problems(env)
    assert any("FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE lists http://tickets-proxy.example:8080" in p
               for p in problems), problems
    env["FAULTDESK_GATEWAY_ALLOW_TICKET_REFERENCE"] = "https://tickets-proxy.example:8443"
    env["FAULTDESK_GATEWAY_ALLOW_MODEL"] = "https://old-model.example/v1"
    assert _deploy_problems(env) == []


def test_span_export_with_headers_to_an_http_endpoint_is_refused_in_production():
    env = verify.fill_env(verify.read_env_example(ENV_EXAMPLE))
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://collector.example:4318"
    assert _deploy_problems(env) == []  # no headers: nothing secret travels
    env["OTEL_EXPORTER_OTLP_HEADERS"] = "x-api-key=abc"
    assert any("OTLP traces endpoint is not https" in p for p in _deploy_problems(env))
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "https://collector.example:4318"
    assert _deploy_problems(env) == []


def test_a_listed_destination_that_cannot_be_read_is_refused_in_production():
    env = verify.fill_env(verify.read_env_example(ENV_EXAMPLE))
    env["FAULTDESK_GATEWAY_ALLOW_TICKET_HELPDESK"] = "https://helpdesk-proxy.example:99999"
    assert any("FAULTDESK_GATEWAY_ALLOW_TICKET_HELPDESK lists https://helpdesk-proxy.example:99999, which cannot be"
               " read" in p for p in _deploy_problems(env))
