# One place that knows how to set moebench up. The README's Quick start is `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU build of torch; GPU machines bring their own torch and run from the checkout.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup run test bench clean llamacpp

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e ".[test,llamacpp]"
	$(PY) -m engine.kernels.cpu     # the engine's CPU kernels, built once (else at first use; never fatal)
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/moebench

# The pinned llama.cpp (engine=llamacpp, tests/llamacpp), built once into $$MOEBENCH_CACHE or
# ~/.cache/moebench/llama.cpp/ (about 7 minutes on 2 cores); a finished build is reused in seconds.
# CUDA where nvcc and a GPU exist: LLAMACPP_CUDA=auto|on|off.
LLAMACPP_CUDA ?= auto
llamacpp: $(STAMP)
	$(PY) -m harness.llamacpp.build --cuda $(LLAMACPP_CUDA)

# One intra-op thread: the tests check correctness, not speed, and tiny models on a small shared
# machine run faster and steadier without OpenMP threads spinning against other processes; one
# pytest worker per core instead (pytest-xdist, -n auto), a worker that runs out of tests taking
# queued ones from another (--dist worksteal: the suite does not end on one busy worker).
# The llama.cpp tests run when `make llamacpp` has built it and otherwise skip, in one summary line
# that says so; MOEBENCH_REQUIRE_LLAMACPP=1 (.ci/run) makes them fail instead when it is missing.
# Then the tests marked `alone` (timing calibrations: another worker on the cores biases them),
# with the machine to themselves; both stages run, and either failing fails `make test`.
PYTEST := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -q
test: $(STAMP)
	@rc=0; \
	$(PYTEST) -n auto --dist worksteal -m "not alone" || rc=$$?; \
	$(PYTEST) -m alone || rc=$$?; \
	exit $$rc

# Micro-benchmarks (benchmarks/micro, pytest-benchmark; not part of `make test`). Each run is saved
# under $(BENCH_STORAGE) (machine-local, git-ignored) and compared with the previous saved run;
# it fails when a benchmark got slower than $(BENCH_FAIL) (the fastest round: other processes on a
# shared machine only ever add time, so min is the stablest statistic). The first run only saves.
# Engine vs transformers: `python benchmarks/bench_vs_transformers.py`.
BENCH_STORAGE ?= .benchmarks
BENCH_FAIL    ?= min:25%
bench: $(STAMP)
	@if ls $(BENCH_STORAGE)/*/*.json >/dev/null 2>&1; then \
	  cmp="--benchmark-compare --benchmark-compare-fail=$(BENCH_FAIL)"; \
	else \
	  cmp=""; echo "bench: no saved run under $(BENCH_STORAGE)/ yet: this run is saved as the baseline"; \
	fi; \
	$(PY) -m pytest benchmarks/micro -q --benchmark-enable --benchmark-autosave \
	  --benchmark-storage=file://$(BENCH_STORAGE) --benchmark-columns=min,median,iqr,rounds $$cmp

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
