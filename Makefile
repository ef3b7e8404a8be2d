# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.nitro-installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[notebook,examples,dev,serve]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m nitro.examples.digits

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check nitro nitro_ipython tests bench
	$(PY) -m ruff format --check nitro nitro_ipython tests bench

bench: $(STAMP)
	$(PY) bench/overhead.py
	$(PY) bench/compile.py
	$(PY) bench/data.py

clean:
	rm -rf $(VENV) .pytest_cache runs
