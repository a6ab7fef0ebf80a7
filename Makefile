# Two commands do all set-up: `make demo` and `make test`. Each creates .venv on first use
# (python3 -m venv + pip; torch is requested as torch==2.13.0, the CPU build on local disk) and
# reuses it afterwards. The stamp file is rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.partita-installed

.PHONY: demo test test-fast lint typecheck format docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,auto]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m partita demo

# Both cores: each worker takes whole files (module fixtures stay shared, and the multi-process
# files keep their own order), in collection order (--no-loadscope-reorder): tests/conftest.py
# puts the slowest files first, so none starts last; `$(PY) -m pytest -q` runs the same tests in
# one process. The 40 slowest tests are listed at the end, to keep the suite well under 15
# minutes. OMP_NUM_THREADS=1: each worker runs torch's kernels on one thread (two workers on
# two threads each only contend for the two cores; the same tests take 8-28 % less CPU,
# docs/architecture.md, "Where the suite's time goes"); a test that needs threads sets them
# itself (torch.set_num_threads).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

# The type checker is mypy (configured in pyproject.toml, [tool.mypy]; checks src/partita).
# mypy, not pyright: mypy is a pure-Python wheel, while pyright's PyPI package fetches the
# pyright npm package (and Node.js when absent) at run time, which an offline CI machine cannot
# do. Its cache (.mypy_cache) makes a second run take seconds: `make typecheck` runs it alone.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples bench conftest.py
	$(VENV)/bin/ruff format --check src tests examples bench conftest.py
	$(VENV)/bin/mypy

typecheck: $(STAMP)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format src tests examples bench conftest.py
	$(VENV)/bin/ruff check --fix src tests examples bench conftest.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache build site src/*.egg-info
