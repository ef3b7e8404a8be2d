# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nitro-installed

.PHONY: setup demo test lint bench browser clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[notebook,examples,agents,dev,serve]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m nitro.examples.digits

# The test files run on TEST_WORKERS processes (pytest-xdist, a file per worker so each module's
# kernels and servers stay together), then the tests that measure the machine run alone.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not serial"
	$(PY) -m pytest -q -m serial

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
