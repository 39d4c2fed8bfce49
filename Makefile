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

# The playground's browser tests drive the system's Chromium through playwright, which
# is told its path: nothing is downloaded at test time. `make browser` installs it with
# apt (as root, or through sudo) when it is missing.
BROWSER_PACKAGE ?= chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install install-dev browser serve test lint bench clean

# The serving install: diffbatch and what it needs, nothing for tests or benchmarks.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q "$(TORCH_PIN)" -e .
	touch $@

# The test install adds the [dev] extra (pytest, ruff, mypy, the openai client, Ray
# Serve, playwright) and the browser the playground's tests drive.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev]"
	$(MAKE) browser
	touch $@

browser:
	@if [ -n "$$DIFFBATCH_CHROMIUM" ]; then echo "browser: $$DIFFBATCH_CHROMIUM"; \
	elif command -v chromium || command -v chromium-browser || command -v google-chrome; then \
		:; \
	elif command -v apt-get >/dev/null 2>&1; then \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BROWSER_PACKAGE); \
	else \
		echo "install Chromium for the playground's browser tests (or set" \
			"DIFFBATCH_CHROMIUM to a Chromium/Chrome binary)" >&2; exit 1; \
	fi

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: install
	$(VENV)/bin/diffbatch serve $(MODEL) --port $(PORT) $(SERVE_ARGS)

# The suite runs in TEST_WORKERS processes, a test file to a process (its module
# fixtures, servers and workers start once); TEST_WORKERS=0 runs it in this one.
TEST_WORKERS ?= 2

test: install-dev
	$(VENV)/bin/ruff check diffbatch tests benchmarks scripts
	$(VENV)/bin/mypy
	DIFFBATCH_REQUIRE_BROWSER=1 $(PY) -m pytest -q -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The code is formatted by hand (ruff check holds the line length and import order);
# no formatter is run.
lint: install-dev
	$(VENV)/bin/ruff check diffbatch tests benchmarks scripts
	$(VENV)/bin/mypy

bench: install-dev
	$(PIP) install -q "$(TORCH_PIN)" -e ".[bench]"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
