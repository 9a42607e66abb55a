"""Processes as ``/proc`` lists them (Linux), for the tools that watch the processes they start (the
bench's CPU and memory figures, the chaos run's pauses)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def processes() -> Iterator[tuple[int, int, int]]:
    """``(pid, ppid, pgrp)`` of every live process; one that exits while it is read is skipped."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # after "pid (comm)": state, ppid, pgrp, … (comm may hold spaces and parentheses)
        fields = stat.rsplit(")", 1)[1].split()
        yield int(entry.name), int(fields[1]), int(fields[2])
