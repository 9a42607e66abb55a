"""The dependency audit of .ci/run (.ci/audit): a known vulnerability fails it, naming the package,
the advisory and the fixed version; packages the service does not know are reported, and an
unreachable service is reported without failing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _audit(tmp_path, report) -> subprocess.CompletedProcess:
    path = tmp_path / "report.json"
    if report is not None:
        path.write_text(json.dumps(report))
    return subprocess.run(["bash", ".ci/audit"], cwd=ROOT, env={"PATH": "/usr/bin:/bin", "AUDIT_REPORT": str(path)},
                          capture_output=True, text=True, timeout=120)


def test_a_known_vulnerability_fails_the_audit(tmp_path):
    done = _audit(tmp_path, {"dependencies": [
        {"name": "django", "version": "5.2.0", "vulns": [{"id": "PYSEC-2025-1", "fix_versions": ["5.2.1"]}]},
        {"name": "httpx", "version": "0.28.1", "vulns": []},
        {"name": "torch", "version": "2.13.0+cpu", "skip_reason": "Dependency not found on PyPI"}]})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 known vulnerabilities" in done.stdout and "django 5.2.0: PYSEC-2025-1 (fixed in 5.2.1)" in done.stdout
    assert "2 packages audited, 1 not known to the service (torch)" in done.stdout


def test_no_vulnerabilities_and_an_unreachable_service_pass(tmp_path):
    done = _audit(tmp_path, {"dependencies": [{"name": "httpx", "version": "0.28.1", "vulns": []}]})
    assert done.returncode == 0 and "0 known vulnerabilities" in done.stdout
    done = _audit(tmp_path / "nowhere", None)  # no report: pip-audit could not reach its service
    assert done.returncode == 0 and "could not be reached" in done.stdout
