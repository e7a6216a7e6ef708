"""OpenMP's idle workers, which must not hold the cores the CPU kernel's helpers need.

torch's intra-op threads are an OpenMP team (GNU libgomp in the CPU wheels). After each parallel
region libgomp's workers spin, waiting for the next one, for GOMP_SPINCOUNT iterations -- by
default 300,000, milliseconds on the CPUs measured here -- and a decode step enters a few regions
(ops on tensors past torch's grain size, the BLAS GEMMs). The CPU kernel's helpers are threads of
its own, outside that team (engine.kernels.cpu: the caller never waits at a barrier for a
descheduled thread), so on a machine with as many cores as threads a spinning worker holds the
core a helper needs: 2-thread decode on the wide benchmark shape ran ~30% slower with the default spin than with a
short one, and prefill no faster (docs/cpu_experts.md has the measurement). libgomp reads the
variable once, when torch loads it, so `quiet_spinning` sets it when the `engine` package is
imported before torch; a wait policy the user set (GOMP_SPINCOUNT, OMP_WAIT_POLICY) is kept.

Owns: the spin count, whether this process got it (`spin_state`), and the environment as the
user gave it (`as_given`: what another program this process starts -- a llama-server, itself an
OpenMP program -- runs with, so it is measured as its users run it). Does not own: the thread
counts (harness.machine, torch.set_num_threads), the kernel (engine.kernels.cpu).

    import engine                       # first: GOMP_SPINCOUNT=10000 unless set
    import torch
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPINCOUNT = "10000"                   # ~0.1-0.3 ms: back-to-back regions still find their workers awake
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_state: dict[str, str] = {}


def quiet_spinning(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set GOMP_SPINCOUNT to SPINCOUNT for libgomp to read when torch loads, unless the user set a
    wait policy or torch is loaded already; returns (and keeps, for `spin_state`) what holds."""
    if "spin" not in _state:
        given = [f"{k}={environ[k]}" for k in USER_SETTINGS if k in environ]
        if given:
            _state["spin"] = f"set by the environment ({', '.join(given)})"
        elif "torch" in sys.modules:
            _state["spin"] = ("libgomp's default (torch was imported before engine, so GOMP_SPINCOUNT could not "
                              "be set in time: idle OpenMP workers may hold the cores the CPU kernel's helpers need)")
        else:
            environ["GOMP_SPINCOUNT"] = SPINCOUNT
            _state["set"] = SPINCOUNT
            _state["spin"] = f"GOMP_SPINCOUNT={SPINCOUNT} (set by engine before torch loaded)"
    return _state["spin"]


def as_given(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The environment without the GOMP_SPINCOUNT `quiet_spinning` set (one the user set stays)."""
    ours = "set" in _state and environ.get("GOMP_SPINCOUNT") == _state["set"]
    return {k: v for k, v in environ.items() if not (ours and k == "GOMP_SPINCOUNT")}


def spin_state() -> str:
    """What OpenMP's workers do when idle in this process, in words (for logs and manifests)."""
    return _state.get("spin") or quiet_spinning()
