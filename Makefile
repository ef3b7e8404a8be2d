# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Two installs into the one .venv, each redone when pyproject.toml changes: what the demo
# needs (nitro, scikit-learn for the digits, matplotlib for its plot, the `nitro train`
# command's options and config files), and everything (every extra: the notebook, serving,
# agents, the command, the test and lint tools) for the rest.
DEMO_STAMP := $(VENV)/.nitro-demo-installed
STAMP      := $(VENV)/.nitro-installed

.PHONY: setup demo test test-loaded lint bench browser clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# the full install includes the demo's: once it is current, the demo installs nothing
$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	@if [ $(STAMP) -nt pyproject.toml ]; then :; else \
		echo "$(PY) -m pip install --quiet -e '.[examples,plot,cli]'"; \
		$(PY) -m pip install --quiet -e ".[examples,plot,cli]"; \
	fi
	@touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e ".[notebook,examples,agents,dev,serve,cli]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

setup: $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m nitro.examples.digits

# The test files run on TEST_WORKERS processes (pytest-xdist, a file per worker so each module's
# kernels and servers stay together), then the tests that measure the machine run alone.
TEST_WORKERS ?= 2

TEST_COMMANDS = \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial" && \
	$(PY) -m pytest -q -m serial

test: $(STAMP)
	$(TEST_COMMANDS)

# The suite beside two CPU-bound neighbours, as on a shared CI machine: no test may depend on
# how fast the machine is. The neighbours start with the suite and are killed when it ends,
# passes or fails, or is interrupted (Ctrl-C reaches the suite, not background commands).
test-loaded: $(STAMP)
	@set -e; \
	yes > /dev/null & one=$$!; \
	yes > /dev/null & two=$$!; \
	trap 'kill $$one $$two 2>/dev/null || true' EXIT; \
	trap 'exit 130' INT TERM; \
	echo "test-loaded: the suite beside two busy neighbours (pids $$one and $$two)"; \
	$(TEST_COMMANDS)

LINTED := nitro nitro_ipython tests bench notebooks conftest.py

lint: $(STAMP)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(VENV)/bin/basedpyright --pythonpath $(PY)

# Chromium and its driver for the browser tests (tests/test_notebook_browser.py), from the
# system's packages: installed when missing, as root with apt-get (CI). Elsewhere those tests
# skip and say how to install them.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
		echo "browser: chromium and chromedriver are installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null && \
		echo "browser: installed chromium and chromium-driver"; \
	else \
		echo "browser: install Chromium and its driver as root: apt-get install chromium chromium-driver"; \
		exit 1; \
	fi

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/compile.py
	$(PY) bench/data.py

clean:
	rm -rf $(VENV) .pytest_cache runs
