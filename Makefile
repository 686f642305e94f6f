# SAC Workbench: `make lab` opens the main notebook, `make test` runs every check.
# `venv` and `system` are internal set-up steps that both depend on.

SHELL := /bin/bash
.DEFAULT_GOAL := lab

VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
# torchtitan for its models and the titan-* parity tests, without its training-only
# requirements (datasets, wandb, tensorboard, ...): only what importing its models and
# graph trainer needs. Nothing here depends on torch, so torch is never changed.
# triton (~285 MB) even on a CPU-only machine: torchtitan 0.3.0's models import it at module
# level (torchtitan/distributed/minimal_async_ep/kernels.py, reached from
# torchtitan.models.llama3 and graph trainer's cpu_offload); `make lab TORCHTITAN=` skips
# torchtitan and triton both (its tests and --model torchtitan:... are then skipped).
TORCHTITAN      ?= torchtitan==0.3.0
TORCHTITAN_DEPS := spmd_types==0.2.3 tyro triton
NOTEBOOK := notebooks/sac_llama3.ipynb

LAB_ARGS    ?=
PYTEST_ARGS ?=

ROOT := $(shell [ "$$(id -u)" = 0 ] && echo yes)
ALLOW_ROOT := $(if $(ROOT),--allow-root,)

export DEBIAN_FRONTEND := noninteractive

.PHONY: venv system jslint lab lint test clean

# --- internal: Python environment -------------------------------------------------------

venv: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

# Reinstalls only when pyproject.toml or this Makefile changes. torch is installed first, and
# only when the venv has no torch>=2.13 yet, so a GPU build installed by hand is kept.
$(STAMP): pyproject.toml Makefile | $(PY)
	@if $(PY) -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(0 if (int(v[0]), int(v[1])) >= (2, 13) else 1)' 2>/dev/null; then \
		echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already in $(VENV): keeping it"; \
	else \
		echo "installing $(TORCH) (CPU wheel)"; \
		$(PIP) install $(TORCH); \
	fi
	$(PIP) install -e '.[test]'
	@# Its requirements first, torchtitan itself last with --no-deps (pip checks no
	@# requirements then): pip would print a red "ERROR: ... torchtitan 0.3.0 requires wandb,
	@# datasets, ..." after an install made with torchtitan present, which on a re-run the
	@# first install is (hence --no-warn-conflicts there: those are the ones left out).
	@if [ -z "$(TORCHTITAN)" ]; then \
		echo "NOTE: TORCHTITAN is empty: torchtitan and triton not installed; its tests will be skipped"; \
	elif $(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then \
		echo "installing what torchtitan's models import: $(TORCHTITAN_DEPS) (triton ~285 MB, imported by torchtitan even on CPU)"; \
		$(PIP) install --no-warn-conflicts $(TORCHTITAN_DEPS) && $(PIP) install --no-deps $(TORCHTITAN) && \
		echo "installed $(TORCHTITAN) without its training-only requirements (datasets, wandb, tensorboard, ...): \`pip check\` lists them as missing; the workbench does not need them"; \
	else \
		echo "NOTE: torchtitan needs Python >= 3.11: its tests will be skipped"; \
	fi
	touch $@

# --- internal: system packages (graphviz `dot`, Debian chromium for the browser test) ---

system:
	@missing=""; \
	command -v dot >/dev/null 2>&1 || missing="$$missing graphviz"; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium fonts-dejavu-core"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing system packages:$$missing"; \
		apt-get update && apt-get install -y --no-install-recommends $$missing; \
	else \
		echo "NOTE: missing system packages:$$missing"; \
		echo "      install them with: sudo apt-get install -y$$missing"; \
		echo "      (without graphviz, graph pictures fail; without chromium, the browser test is skipped)"; \
	fi

# --- internal: the explorer's JS/CSS linter (biome, pinned in package.json) ---------------

# `npm ci` installs package-lock.json's biome into node_modules/ again only when package.json
# or the lock file changes; without npm one line says the JS/CSS check is skipped.
NPM       ?= npm
NPM_STAMP := node_modules/.installed

$(NPM_STAMP): package.json package-lock.json
	$(NPM) ci --no-audit --no-fund
	touch $@

jslint:
	@if command -v $(NPM) >/dev/null 2>&1; then \
		{ $(MAKE) -q $(NPM_STAMP) || $(MAKE) --no-print-directory $(NPM_STAMP); } && \
		node_modules/.bin/biome check --error-on-warnings; \
	else \
		echo "NOTE: npm is not installed: the explorer's JS/CSS are not checked (biome); install it with: sudo apt-get install -y npm"; \
	fi

# --- user targets -------------------------------------------------------------------------

# Opens working copies in out/lab/ (git-ignored, made once; delete one to get the repo's
# version again), trusted so their pictures show: running cells never modifies the repo. The
# kernels import studies/ (not installed) from the repo's root, on their PYTHONPATH.
LAB_DIR := out/lab

lab: venv system
	mkdir -p $(LAB_DIR)
	@for nb in notebooks/*.ipynb; do \
		[ -e $(LAB_DIR)/$$(basename $$nb) ] || cp $$nb $(LAB_DIR)/; \
	done
	$(VENV)/bin/jupyter trust $(LAB_DIR)/*.ipynb
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} exec $(VENV)/bin/jupyter-lab $(ALLOW_ROOT) $(LAB_ARGS) $(LAB_DIR)/$(notdir $(NOTEBOOK))

lint: venv
	$(VENV)/bin/ruff check workbench studies tests scripts
	$(VENV)/bin/ruff format --check workbench studies tests scripts
	$(VENV)/bin/mypy
	@$(MAKE) --no-print-directory jslint

test: venv system
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest tests notebooks --nbval --nbval-sanitize-with notebooks/sanitize.cfg \
		--timeout=1200 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -exec rm -rf {} +
