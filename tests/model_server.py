"""The real local model server for the ``model`` tests (``make test-model``; ``make model`` builds it).

:func:`running_model_server` starts llama.cpp's OpenAI-compatible server with SmolLM2-135M-Instruct
(:mod:`tools.modelserver`) on a free port and yields its base URL; ``tests/conftest.py`` wraps it in
the session-scoped ``real_model_server`` fixture (``model_server`` is the scripted one), so every
test of the session shares one server. When ``var/model-venv`` is missing the tests are skipped with
the reason, except under ``make test-model`` (``FAULTDESK_REQUIRE_MODEL=1``), where a missing model
fails them.

:func:`model_provider` builds the product's provider for that server the way the agent does, from
a task's artifact bundle (:func:`apps.llm.providers.provider_for`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tools import modelserver

#: set by ``make test-model``: a missing model server fails the tests instead of skipping them
REQUIRE_ENV = "FAULTDESK_REQUIRE_MODEL"


def model_required() -> bool:
    """Whether this run must have the real model server (``FAULTDESK_REQUIRE_MODEL=1``)."""
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes")


@contextmanager
def running_model_server(log_dir: Path, *, api_key: str) -> Iterator[str]:
    """The real model server on a free port, requiring ``api_key``; yields its base URL
    (``http://127.0.0.1:<port>/v1``) and stops it afterwards. Its log is ``log_dir/model-server.log``.
    Skips (fails under ``FAULTDESK_REQUIRE_MODEL=1``) when ``make model`` has not run."""
    if not modelserver.available():
        reason = (f"needs the real local model server, which is not built ({modelserver.VENV} is missing or "
                  "incomplete): run `make model`, or `make test-model`, which builds it")
        if model_required():
            pytest.fail(f"{REQUIRE_ENV}=1 but the model {reason}", pytrace=False)
        pytest.skip(reason)
    with modelserver.ModelServer(log_path=Path(log_dir) / "model-server.log", api_key=api_key) as server:
        yield server.base_url


def model_provider(base_url: str, **bundle_entries):
    """The product's OpenAI-compatible provider for the model server at ``base_url``, built by
    :func:`apps.llm.providers.provider_for` from the model part of an artifact bundle as a task
    created under ``FAULTDESK_MODEL_SERVER=llama`` pins it (the model alias, this base URL, the
    settings' output cap and price, ``response_format`` ``json_object``: the only form in which
    llama-cpp-python's server applies the schema; ``bundle_entries`` add or override entries),
    with the settings' API key."""
    from django.conf import settings

    from apps.llm.providers import OPENAI_COMPATIBLE, OUTPUT_PARSER_VERSION, provider_for

    conf = settings.FAULTDESK
    bundle = {"model_provider": OPENAI_COMPATIBLE, "model": modelserver.MODEL_ALIAS, "model_base_url": base_url,
              "max_output_tokens": conf["MODEL_MAX_OUTPUT_TOKENS"],
              "units_per_1k_tokens": conf["MODEL_UNITS_PER_1K_TOKENS"], "output_parser": OUTPUT_PARSER_VERSION,
              "response_format": "json_object", **bundle_entries}
    return provider_for(bundle, conf)
