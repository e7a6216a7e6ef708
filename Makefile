# One place that knows how to set moebench up. The README's Quick start is `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch; GPU machines bring their own torch and run from the checkout.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup run test test-all bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/moebench

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_vs_transformers.py

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
