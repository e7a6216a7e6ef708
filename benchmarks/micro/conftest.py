"""Micro-benchmarks (pytest-benchmark): the engine's hot pieces and the simulator, one function each.

Not part of `make test` (they live outside tests/, and the project's pytest addopts disable
benchmarks). Run them with `make bench`, which enables pytest-benchmark, saves every run
under .benchmarks/ (machine-local history) and compares it with the previous saved run:

    make bench                                   # run, save, compare with the last saved run
    .venv/bin/python -m pytest benchmarks/micro --benchmark-enable        # just run

Torch runs on one thread here, like the test suite: on a shared 2-core machine two intra-op
threads plus any other process make timings swing by 10-100x (OpenMP spin-waits).
"""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
