# make demo: create .venv, install, run the CPU demo (RL from random init, then SFT → RL).
# make test: create .venv, install, check the docs (mkdocs build --strict), run the test suite.
# make test-fast: the unit and contract tests only (≤ 3 min), for the inner loop.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export PREFECT_HOME := $(CURDIR)/.prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export PREFECT_LOGGING_LEVEL ?= WARNING
# byte-code: the install compiles nothing (infra/install.py); every module is compiled on its first
# import, once, into .venv/pycache (not next to the sources), also where the environment sets
# PYTHONDONTWRITEBYTECODE: without cached byte-code every process compiles all it imports again
# (torch, transformers, mlflow and prefect: ≈17 CPU-s instead of ≈8)
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv system demo test test-fast docs docs-check lint format bench bench-trl clean stack-up stack-down stack-status ui-check

venv: $(STAMP)

# Debian packages the project needs: bubblewrap (the episode sandbox, miles_core/envs/sandbox.py)
system:
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null 2>&1 && $$SUDO apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
	  echo "warning: could not install bubblewrap (apt-get install bubblewrap); sandboxed episodes will fail"; }

# infra/install.py: uv configured from pip's own configuration (≈15 s; pip alone ≈150 s), pip
# if uv is not available
$(STAMP): pyproject.toml infra/install.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m infra.install '.[test,openenv,server,ray]'
	touch $(STAMP)

# torchao 0.18, an independent MX quantizer the precision tests compare against, kept out of the
# venv: transformers imports an installed torchao in every process that builds a model
TORCHAO := $(VENV)/torchao
$(TORCHAO)/.installed: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --target $(TORCHAO) "torchao==0.18.0"
	touch $@

demo: venv system
	$(BIN)/miles train --config examples/say_a.yaml --set checkpoint.overwrite=true
	$(BIN)/miles train --config examples/reverse_sft_rl.yaml --set checkpoint.overwrite=true

# the user docs (docs/, mkdocs.yml): `make docs` builds the site into site/; make test checks
# that they build strictly (broken links, anchors, generated pages) and that the benchmark
# tables in docs/benchmarks.md match benchmarks/results/*.json
docs: venv
	$(BIN)/mkdocs build --strict

docs-check: venv
	$(BIN)/python benchmarks/render_results.py --check
	$(BIN)/python -m infra.docs_check

# two pytest workers (pytest-xdist), one module per worker at a time: the suite waits on servers
# and subprocesses about half the time, so two workers on two cores take ~55% of one's time.
# --no-loadscope-reorder: modules in conftest.py's order (the longest first), not xdist's default
# of most tests first. PYTEST_WORKERS=0 runs in one process (debugging, -x, pdb).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: venv $(TORCHAO)/.installed system docs-check
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

# the inner loop: unit and contract tests, no training runs, flows or multi-rank launches
# (tests marked `slow`; tests/README.md lists the tiers)
test-fast: venv $(TORCHAO)/.installed system
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_PARALLEL)

lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python benchmarks/step_time.py

# ours vs TRL's GRPOTrainer (benchmarks/vs_trl.py); TRL (a peer, never a dependency) in .venv-trl
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed
$(TRL_STAMP): $(STAMP)
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install -q "torch==2.13.0" \
	  "transformers==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("transformers"))')" \
	  "trl==1.16.0" "accelerate==1.15.0" "datasets==5.2.0" numpy
	touch $(TRL_STAMP)

bench-trl: venv $(TRL_STAMP)
	$(BIN)/python benchmarks/vs_trl.py

# the local production stack (infra/local_stack.py): Prefect server, MLflow server, S3 (moto)
stack-up: venv
	infra/local-stack up

stack-down:
	infra/local-stack down

stack-status:
	infra/local-stack status

# headless Chromium screenshots of the Prefect and MLflow UIs into ui-check/ (not in make test)
ui-check: venv
	$(BIN)/python -m infra.ui_check

clean:
	rm -rf $(VENV) .prefect mlflow.db mlruns checkpoints *.egg-info site
