"""``make bench`` with ``--profile``: py-spy samples the worker processes during the one-worker
end-to-end run, and the collapsed stacks are summed per function — inclusive (the function and
what it calls) and self — so that the largest cost per task has a name.

Only samples of a thread holding the GIL are kept (``--gil``): a thread waiting on PostgreSQL,
Redis or HTTP inside a C extension (psycopg's wait, its send) releases the GIL, and without the
flag py-spy counted those waits as if they were the worker's own time (a third of the samples).
The shares are of the Python interpreter's time; NumPy's kernels that release the GIL are left
out too."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

from tools.bench.harness import BIN

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


#: ``--profile-wall``: sample every thread whether it runs or waits (py-spy ``--idle``), so the shares
#: are of wall time — where a worker process waits (a commit's WAL flush, a statement's round trip,
#: the ticket system's answer) as well as where it computes. Set by ``python -m tools.bench``.
WALL = False


class Sampler:
    """``py-spy record`` on process ``pid`` and its children, writing collapsed stacks of the
    threads that hold the GIL (with :data:`WALL`: of every thread, running or waiting) to ``out`` at
    ``rate`` samples/s until :meth:`stop`."""

    def __init__(self, pid: int, out: Path, *, rate: int = 200):
        self.out = out
        self.proc = subprocess.Popen(  # noqa: S603
            [str(BIN / "py-spy"), "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate",
             str(rate), "--nonblocking", "--idle" if WALL else "--gil", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        """Stop sampling (SIGINT makes py-spy write its file) and wait for the file."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _name(frame: str) -> str:
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match.group("file")
    for marker in ("/site-packages/", "/work/main/", "/lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{match.group('func')} ({path})"


def summarize(raw: Path, *, top: int = 15) -> dict:
    """Sum collapsed stacks ``frame;frame;… count`` per function. Returns ``{"samples": int,
    "inclusive": [(function, share)], "self": [(function, share)]}``, shares in 0..1, largest
    first, ``top`` of each."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_name(f) for f in stack.split(";") if f and not f.startswith("process ")
                  and not f.startswith("thread ")]
        for name in set(frames):
            inclusive[name] += n
        if frames:
            own[frames[-1]] += n
    share = (lambda c: [(k, v / total) for k, v in c.most_common(top)]) if total else (lambda c: [])
    return {"samples": total, "inclusive": share(inclusive), "self": share(own)}


def report(raw: Path, *, top: int = 15, label: str = "worker") -> dict:
    """Print :func:`summarize`'s tables for ``raw`` (the processes of role ``label``) and return
    them. The inclusive table leaves out the frames nearly every sample passes through (the
    process's own loop: Celery's or gunicorn's, at 85% and more), which name no cost."""
    result = summarize(raw, top=top + 40)
    print(f"  profile of the {label} processes: {result['samples']:,} CPU samples ({raw})", flush=True)
    print("  inclusive share (function and what it calls):", flush=True)
    for name, s in [(n, s) for n, s in result["inclusive"] if s < 0.85][:top]:
        print(f"    {s:6.1%}  {name}", flush=True)
    print("  self share:", flush=True)
    for name, s in result["self"][:top]:
        print(f"    {s:6.1%}  {name}", flush=True)
    return result
