"""The cost model (DESIGN.md §8): bytes and FLOPs of a scenario -> predicted time per phase on a
hardware profile, calibrated by measuring this machine and validated against measured runs.

Owns: hardware profiles (`profiles`: conf/hardware/*.yaml + fitted overheads), the
hardware-free work of a scenario (`work`), the time model and its tidy rows (`timemodel`: `predict`,
source="model"), calibration (`calibrate`: `moebench calibrate`), and predicted-vs-measured
error (`validate`). Does not own: measuring runs (harness.runner) or the results schema
(harness.results).

    from harness.costmodel import predict, load_profile, WorkloadShape
    p = predict("mixtral-8x7b", "fetch", WorkloadShape(4096, gen_tokens=64), "rtx5090-pcie5-x16",
                capacity=4, dtype="bfloat16")
    p.phases["decode"].tok_per_s
    p.table(workload="chat")                  # tidy rows, source="model"

What-if over profiles: run `predict` with each of `list_profiles()`; datasheet profiles give
the hardware bound (no software overhead), a calibrated profile adds this engine's fitted
overheads.
"""
from harness.costmodel.timemodel import PhaseEstimate, Prediction, predict, what_if
from harness.costmodel.profiles import (HardwareProfile, Overheads, ProfileError, list_profiles, load_profile,
                                        save_profile)
from harness.costmodel.work import PlacementSpec, Routing, WorkloadShape

__all__ = ["predict", "what_if", "Prediction", "PhaseEstimate", "HardwareProfile", "Overheads", "ProfileError",
           "list_profiles", "load_profile", "save_profile", "PlacementSpec", "Routing", "WorkloadShape"]
