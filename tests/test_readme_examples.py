"""The README's shell examples stay true: every fenced ``sh`` block marked with a
``<!-- runnable: … -->`` comment runs, as it stands, against real processes (web, a worker, beat,
the reference ticket service) seeded by ``tools.demo_data.seed``, and every ``curl`` in it gets the HTTP
status its ``# → NNN`` comment says. A renamed route or response field fails here.

How a block is checked: each ``curl`` in a marked block must carry a ``# → NNN`` comment at the end
of its (possibly backslash-continued) command; a block with an unannotated ``curl`` is refused.
The block runs under ``bash`` with ``set -euo pipefail`` and a ``curl`` shell function that records
each call's status and fails the script on an unexpected one, so a field the block reads from a
response (``json_get``) that is gone fails it too.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import ROOT, demo_stack

README = ROOT / "README.md"
MARKER = re.compile(r"^<!--\s*runnable:.*-->\s*$")
EXPECT = re.compile(r"#\s*→\s*(\d{3})\s*$")
CURL = re.compile(r"(?<![\w./-])curl(?=\s)")

#: ``curl`` as the blocks see it: the real curl writes the body to stdout as usual and the status
#: to ``$README_CALLS`` as ``<line> <expected> <got>``; a status other than ``$EXPECT`` fails.
PRELUDE = r"""set -euo pipefail
curl() {
  local out code
  out=$(mktemp)
  if ! code=$(command curl -o "$out" -w '%{http_code}' "$@"); then
    rm -f "$out"; echo "README line ${README_LINE:-?}: curl failed: curl $*" >&2; return 1
  fi
  echo "${README_LINE:-?} ${EXPECT:-none} $code" >> "$README_CALLS"
  cat "$out"; rm -f "$out"
  if [ "$code" != "${EXPECT:-}" ]; then
    echo "README line ${README_LINE:-?}: expected HTTP ${EXPECT:-?}, got $code: curl $*" >&2; return 1
  fi
}
"""


@dataclass(frozen=True)
class Block:
    """A runnable block: its first line's number in the README (1-based) and its lines."""

    start: int
    lines: list[str]


def runnable_blocks(text: str) -> list[Block]:
    """The fenced ``sh`` blocks that follow a ``<!-- runnable: … -->`` line in ``text``. Raises
    ValueError for a marker not followed by a fenced ``sh`` block."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not MARKER.match(line):
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```sh":
            raise ValueError(f"README line {i + 1}: a runnable marker must be followed by a ```sh block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"README line {i + 2}: the ```sh block is not closed")
        blocks.append(Block(start=i + 3, lines=lines[i + 2:end]))
    return blocks


def instrument(block: Block) -> tuple[str, dict[int, str]]:
    """The block as a script whose every ``curl`` carries ``EXPECT=<status> README_LINE=<n>``, and
    ``{README line: expected status}`` for each command with a ``curl``. Raises ValueError for a
    ``curl`` whose command has no ``# → NNN`` comment."""
    out: list[str] = []
    expected: dict[int, str] = {}
    command: list[tuple[int, str]] = []  # the lines of one backslash-continued command
    for offset, line in enumerate(block.lines):
        command.append((block.start + offset, line))
        if line.rstrip().endswith("\\"):
            continue
        first, last = command[0][0], command[-1][1]
        if any(CURL.search(text.split("#", 1)[0]) for _, text in command):
            m = EXPECT.search(last)
            if m is None:
                raise ValueError(f"README line {first}: a curl without a '# → NNN' status comment")
            expected[first] = m[1]
            command = [(n, CURL.sub(f"EXPECT={m[1]} README_LINE={first} curl", text)) for n, text in command]
        out += [text for _, text in command]
        command = []
    return "\n".join(out) + "\n", expected


def test_runnable_blocks_are_found_and_every_curl_is_annotated():
    """Given the README, its marked API block is found, and instrumenting it annotates every curl
    (a block with an unannotated curl is refused, so a new example cannot escape the check)."""
    blocks = runnable_blocks(README.read_text())
    assert blocks, "the README has no runnable block"
    script, expected = instrument(blocks[0])
    assert len(expected) >= 20 and script.count("EXPECT=") == script.count("curl ") - script.count("command curl")
    with pytest.raises(ValueError, match="without a"):
        instrument(Block(start=1, lines=['curl -s "$BASE/healthz"']))
    with pytest.raises(ValueError, match="must be followed"):
        runnable_blocks("<!-- runnable: x -->\ntext\n")


def _run(script: str, *, env: dict, calls: Path) -> subprocess.CompletedProcess:
    calls.unlink(missing_ok=True)
    return subprocess.run(["bash", "-c", PRELUDE + script], cwd=ROOT, env={**env, "README_CALLS": str(calls)},  # noqa: S603, S607
                          capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_readmes_runnable_blocks_hold_against_real_processes(transactional_db, tmp_path):
    """Given make demo's processes and seed, when each runnable README block runs as it stands,
    then it exits 0 and every annotated curl ran and got its status; and when a route or a
    response field the block uses is renamed, the same check fails."""
    blocks = runnable_blocks(README.read_text())
    with demo_stack(tmp_path) as (stack, credentials):
        env = {**stack.env, "BASE": stack.web, "CREDS": str(credentials)}
        calls = tmp_path / "calls.txt"
        for block in blocks:
            script, expected = instrument(block)
            done = _run(script, env=env, calls=calls)
            assert done.returncode == 0, f"{done.stderr[-3000:]}\n{stack.logs()}"
            seen = [line.split() for line in calls.read_text().splitlines()]
            assert all(want == got for _, want, got in seen), seen
            assert {int(n) for n, _, _ in seen} == set(expected), "every annotated curl ran"

        # The check can fail: a renamed route, and a renamed field the block reads.
        script, _ = instrument(blocks[0])
        for broken, why in ((script.replace("/api/devices/", "/api/device/", 1), "expected HTTP 200, got 404"),
                            (script.replace("json_get 0 id)", "json_get 0 device_id)", 1), "KeyError: 'device_id'")):
            assert broken != script
            done = _run(broken, env=env, calls=calls)
            assert done.returncode != 0 and why in done.stderr, done.stderr[-2000:]
