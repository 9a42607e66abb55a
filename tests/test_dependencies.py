"""Dependencies: the floors in pyproject.toml sit past releases with published vulnerabilities,
and constraints.txt pins exactly what is installed (what CI tests and audits)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

#: The first release without the published vulnerabilities each floor must clear.
PATCHED = {"django": "5.2.19", "djangorestframework": "3.15.2", "gunicorn": "23.0", "pypdf": "6.4"}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    return {r.name.lower(): r for r in reqs}


def test_no_floor_admits_a_release_with_a_published_vulnerability():
    reqs = _requirements()
    for name, patched in PATCHED.items():
        floors = [Version(s.version) for s in reqs[name].specifier if s.operator in (">=", "==", "~=")]
        assert floors and min(floors) >= Version(patched), f"{name}: {reqs[name]} admits releases before {patched}"


def test_constraints_pin_every_installed_dependency_to_what_is_installed():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    for name in _requirements():
        key = name.replace("_", "-")
        assert key in pins, f"{name} is not pinned in constraints.txt"
        assert metadata.version(name) == pins[key], f"{name}: installed {metadata.version(name)}, pinned {pins[key]}"
