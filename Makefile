# diffbatch: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned here so that pip takes the CPU wheel instead of a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
MODEL ?=
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install install-dev serve test lint bench clean

# The serving install: diffbatch and what it needs, nothing for tests or benchmarks.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q "$(TORCH_PIN)" -e .
	touch $@

# The test install adds the [dev] extra (pytest, ruff, the openai client, Ray Serve).
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: install
	$(VENV)/bin/diffbatch serve $(MODEL) --port $(PORT) $(SERVE_ARGS)

test: install-dev
	$(VENV)/bin/ruff check diffbatch tests benchmarks scripts
	$(PY) -m pytest -q -p no:cacheprovider

lint: install-dev
	$(VENV)/bin/ruff check diffbatch tests benchmarks scripts
	$(VENV)/bin/ruff format --check diffbatch tests benchmarks scripts

bench: install-dev
	$(PIP) install -q "$(TORCH_PIN)" -e ".[bench]"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
