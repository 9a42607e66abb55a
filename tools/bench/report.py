"""``python -m tools.bench.report [var/bench/latest.json]``: a bench run's figures as a Markdown
table (figure, value, unit, note) under a line naming the machine — what docs/performance.md
quotes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.bench.harness import BENCH_DIR


def markdown(run: dict) -> str:
    """The table for one run's JSON (``{"started_at", "machine", "figures"}``)."""
    m = run["machine"]
    lines = [f"Run of {run['started_at']} on {m['cpus']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
             f"Python {m['python']}, kernel {m['kernel']}.", "",
             "| figure | value | unit | note |", "|---|---|---|---|"]
    for name, f in run["figures"].items():
        value = f["value"]
        shown = f"{value:,}" if isinstance(value, int) else (f"{value:,.3f}" if isinstance(value, float) else value)
        note = str(f.get("note", "")).replace("|", "\\|")
        lines.append(f"| `{name}` | {shown} | {f.get('unit', '')} | {note} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else BENCH_DIR / "latest.json"
    if not path.exists():
        print(f"no bench figures at {path}: run make bench first", file=sys.stderr)
        return 2
    print(markdown(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
