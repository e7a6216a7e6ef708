"""`moebench calibrate`: measure this machine and write a hardware profile (source: measured).

Owns: the micro-benchmarks -- GEMM and GEMV rates (fp32, and bf16 where the CPU/GPU does
it), the engine's expert FFN (`engine.layers.expert_ffn`) at real models' expert shapes,
host RAM bandwidth, and host<->device copies (CUDA: pinned and pageable through torch, and
through CuPy as an independent check when it is importable; the emulated device: the
engine's own worker-thread memcpy) -- and assembling them, with the fitted software
overheads (harness.costmodel.fit), into a profile file. Does not own: the profile format
(harness.costmodel.profiles) or the fit (harness.costmodel.fit).

    moebench calibrate                       # -> conf/hardware/measured.yaml (+ measured.overheads.json)
    moebench calibrate --quick --out /tmp/hw/here.yaml      # ~10 s: fewer sizes and repeats

Conventions: a rate is the best of its repeats (what the hardware can do; the engine probes
use medians instead, being what a run typically sees). RAM and device-memory bandwidth
count a copy of N bytes as 2N (read + write, STREAM's convention); link figures count N.
On the CPU-emulated device there is no link and no separate device: device_tflops and
device_mem_gbps are the CPU's own, and h2d/d2h are memcpy rates of an expert-sized buffer
(on the engine's copy worker thread for h2d), written with `link: emulated ...` so nobody
mistakes them for a bus.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.dtypes import DTYPES
import torch.nn.functional as F

from engine.config import preset
from engine.devices import Device
from engine.layers import expert_ffn
from harness.costmodel.profiles import PROFILE_DIR, HardwareProfile, save_profile
from harness.manifest import cpu_model

LINK_EXPERT = "qwen3-30b-a3b"       # whose expert size the link benchmark copies (9 MiB in bf16)


def expert_shape(model: str) -> tuple[int, int]:
    """(hidden, expert intermediate) of a preset: a real model's expert, for the FFN and link benchmarks."""
    cfg = preset(model)
    return cfg.hidden_size, cfg.moe_intermediate_size


def best_time(fn: Callable[[], Any], repeats: int, kind: str = "cpu") -> float:
    """Fastest of `repeats` timed calls after one warm-up (synchronised on CUDA)."""
    fn()
    _sync(kind)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(kind)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()


def _supports(dtype: torch.dtype, device: str) -> bool:
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device)
        (a @ a).sum().item()
        return True
    except (RuntimeError, TypeError):
        return False


# --- micro-benchmarks -------------------------------------------------------------------------
GEMM_MAX_CALL_S = 0.1     # a size whose matmul takes longer ends the dtype's sizes (see gemm_rates)


def gemm_rates(device: str, dtypes: list[str], sizes: tuple[int, ...], repeats: int) -> dict[str, float]:
    """GFLOP/s of square matmuls, per dtype and size (ascending): {"float32@1024": ...}. A dtype
    whose matmul at one size took over GEMM_MAX_CALL_S is not timed at the larger ones: a rate that
    low is compute-bound at every size, and 8x the work a size says nothing the last one did not
    (bf16 on a CPU without bf16 arithmetic: ~1 GFLOP/s, 2 s a call at 1024, 18 s at 2048)."""
    out = {}
    for name in dtypes:
        dt = DTYPES[name]
        if not _supports(dt, device):
            continue
        for n in sorted(sizes):
            a, b = torch.randn(n, n, device=device).to(dt), torch.randn(n, n, device=device).to(dt)
            t = best_time(lambda: a @ b, repeats, device)
            out[f"{name}@{n}"] = 2 * n ** 3 / t / 1e9
            if t > GEMM_MAX_CALL_S:
                break
    return out


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")     # Linux sysfs: index*/size, "48K", "480M"
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The largest cache the CPU reports (`caches`/index*/size, Linux sysfs), or None where it reports none."""
    sizes = []
    for f in caches.glob("index*/size"):
        text = f.read_text().strip()
        m = re.fullmatch(r"(\d+)([KMG]?)", text)
        if m is None:
            raise ValueError(f"cannot read a cache size from {f}: {text!r} (expected e.g. '48K', '480M')")
        sizes.append(int(m.group(1)) * _SIZE_UNITS[m.group(2)])
    return max(sizes, default=None)


def cold_mib(mib: int, caches: Path | None = None) -> int:
    """`mib`, raised to twice the last-level cache (`last_level_cache_bytes(caches)`, this CPU's by
    default): a buffer the caches cannot keep between a rate's repeats, so the rate is RAM's, not
    the cache's. Twice the reported size rather than the size: a host's caches can keep less than
    they report, so a matrix of the reported size can still be read partly from cache (a dated
    measurement: docs/history/2026-12-01-cpu-kernels-and-rates.md)."""
    llc = last_level_cache_bytes(CPU_CACHES if caches is None else caches)
    return mib if llc is None else max(mib, -(-2 * llc // (1 << 20)))


def gemv_matrix(device: str, dtype: torch.dtype, mib: int, cold: bool = True, cols: int = 4096) -> torch.Tensor:
    """The weight matrix a GEMV rate reads: `mib` MiB of `dtype`, with `cold` on the CPU at least
    `cold_mib` (read from RAM, as a decode step reads a model's weights; random values, made in place)."""
    if cold and device == "cpu":
        mib = cold_mib(mib)
    rows = max(1, (mib << 20) // (cols * dtype.itemsize))
    return torch.empty(rows, cols, dtype=dtype, device=device).uniform_(-1, 1)


def gemv_rates(device: str, dtypes: list[str], mib: int, repeats: int, cold: bool = True) -> dict[str, float]:
    """Effective GB/s of weight reads in a matrix-vector product over a `mib` MiB matrix (`gemv_matrix`:
    with `cold`, on the CPU at least twice its last-level cache; without, exactly `mib`, maybe cached)."""
    return {name: _gemv_gbps(device, DTYPES[name], mib, repeats, cold) for name in dtypes
            if _supports(DTYPES[name], device)}


def _gemv_gbps(device: str, dtype: torch.dtype, mib: int, repeats: int, cold: bool) -> float:
    """One dtype's GEMV rate (its matrix freed on return: two dtypes' never live at once)."""
    w = gemv_matrix(device, dtype, mib, cold)
    x = torch.randn(1, w.shape[1], device=device).to(dtype)
    return w.numel() * dtype.itemsize / best_time(lambda: F.linear(x, w), repeats, device) / 1e9


def expert_rates(device: str, dtype: str, models: list[str], tokens: tuple[int, ...], repeats: int) -> dict[str, float]:
    """The engine's expert FFN on real expert shapes: GFLOP/s per (model, tokens), and the
    weight-read GB/s at one token ({"qwen3-30b-a3b@1:cached GB/s": ...}) -- one expert read again
    and again, so from the caches where it fits (RAM's rate is `gemv_rates`')."""
    dt = DTYPES[dtype]
    out = {}
    for m in models:
        D, I = expert_shape(m)
        packed = (torch.randn(3 * I * D, device=device) * 0.02).to(dt)
        for n in tokens:
            x = torch.randn(n, D, device=device).to(dt)
            t = best_time(lambda: expert_ffn(x, packed, D, I, "silu"), repeats, device)
            out[f"{m}@{n}:GFLOP/s"] = 2 * n * 3 * D * I / t / 1e9
            if n == 1:
                out[f"{m}@1:cached GB/s"] = packed.numel() * dt.itemsize / t / 1e9
    return out


def ram_bandwidth(mib: int, repeats: int) -> float:
    """Host RAM GB/s of a large tensor copy, counting read + write (2N per N copied); each buffer
    at least `cold_mib`."""
    x = torch.empty((cold_mib(mib) << 20) // 4, dtype=torch.float32).fill_(1.0)
    y = torch.empty_like(x)
    t = best_time(lambda: y.copy_(x), repeats)
    return 2 * x.numel() * 4 / t / 1e9


def emulated_link(nbytes: int, repeats: int) -> dict[str, float]:
    """The emulated device's "link": the engine's worker-thread memcpy (h2d) and main-thread
    copy to host (d2h) of an `nbytes` buffer, GB/s counting N per copy."""
    dev = Device("cpu")
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)

    def h2d() -> None:
        dev.wait(dev.copy_h2d(dst, src))
    out = {"h2d": nbytes / best_time(h2d, repeats) / 1e9,
           "d2h": nbytes / best_time(lambda: dev.to_host(src), repeats) / 1e9}
    dev.synchronize()
    return out


def cuda_links(nbytes: int, repeats: int) -> dict[str, float]:
    """CUDA host<->device GB/s through torch, pinned and pageable, timed with CUDA events."""
    out: dict[str, float] = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        tag = "pinned" if pinned else "pageable"
        for direction, fn in (("h2d", lambda: dev.copy_(host, non_blocking=pinned)),
                              ("d2h", lambda: host.copy_(dev, non_blocking=pinned))):
            best = float("inf")
            fn()
            for _ in range(repeats):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                best = min(best, s.elapsed_time(e) / 1e3)
            out[f"{direction}_{tag}"] = nbytes / best / 1e9
    return out


def cupy_links(nbytes: int, repeats: int) -> dict[str, float] | None:
    """The same pinned copies through CuPy (an independent path), or None without CuPy."""
    try:
        import cupy as cp
        import numpy as np
    except ImportError:
        return None
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    dev = cp.empty(nbytes, dtype=cp.uint8)
    out = {}
    for direction, fn in (("h2d", lambda: dev.set(host)), ("d2h", lambda: dev.get(out=host))):
        best = float("inf")
        fn()
        for _ in range(repeats):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            fn()
            e.record()
            e.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(s, e) / 1e3)
        out[f"{direction}_pinned"] = nbytes / best / 1e9
    return out


def device_copy_bandwidth(mib: int, repeats: int) -> float:
    """CUDA device-memory GB/s of a device-to-device copy (read + write)."""
    x = torch.empty((mib << 20) // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / best_time(lambda: y.copy_(x), repeats, "cuda") / 1e9


# --- the profile --------------------------------------------------------------------------------
def measure(device: str = "auto", dtype: str = "float32", quick: bool = False, name: str = "measured",
            fit: bool = True) -> tuple[HardwareProfile, dict[str, Any]]:
    """Run every benchmark (and the overhead fit); return the profile and the raw figures.

    Full mode runs the micro-benchmarks twice, before and after the engine probes, and keeps
    each figure's better pass: a busy spell of the machine then has to span both to lower it."""
    from harness.costmodel.fit import fit_overheads, run_probes

    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    raw: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                           "cpu": cpu_model() or platform.processor() or platform.machine(),
                           "cores": os.cpu_count()}
    raw.update(micro_benchmarks(kind, dtype, quick))
    probes = run_probes(kind, dtype, quick) if fit else []
    if not quick:
        raw = _better(raw, micro_benchmarks(kind, dtype, quick))
    profile = _profile(raw, kind, dtype, name)
    if fit:
        overheads, report = fit_overheads(probes, profile, dtype)
        raw["fit"] = report
        profile = profile.replace(overheads=overheads)
    return profile, raw


def micro_benchmarks(kind: str, dtype: str, quick: bool) -> dict[str, Any]:
    """One pass of every micro-benchmark on `kind` ("cpu": the emulated device; "cuda")."""
    reps = 5 if quick else 10
    dtypes = ["float32", "bfloat16"]
    raw: dict[str, Any] = {
        "cpu_gemm_gflops": gemm_rates("cpu", dtypes, (512, 1024) if quick else (256, 512, 1024, 2048), reps),
        "cpu_gemv_gbps": gemv_rates("cpu", dtypes, 64 if quick else 256, reps),
        "cpu_expert": expert_rates("cpu", dtype, ["qwen3-30b-a3b"] if quick else ["qwen3-30b-a3b", "olmoe-1b-7b"],
                                   (1, 64, 512), reps),
        "cpu_ram_gbps": ram_bandwidth(64 if quick else 512, reps)}
    D, I = expert_shape(LINK_EXPERT)
    link_bytes = 3 * D * I * DTYPES[dtype].itemsize
    if kind == "cuda":
        raw["gpu_gemm_gflops"] = gemm_rates("cuda", dtypes + ["float16"], (2048, 4096) if quick else (1024, 4096, 8192),
                                            reps)
        raw["gpu_gemv_gbps"] = gemv_rates("cuda", dtypes + ["float16"], 256 if quick else 1024, reps)
        raw["gpu_mem_gbps"] = device_copy_bandwidth(256 if quick else 1024, reps)
        raw["cuda_links"] = cuda_links(link_bytes if quick else 256 << 20, reps)
        raw["cupy_links"] = cupy_links(link_bytes if quick else 256 << 20, reps)
    else:
        tiny = preset("tiny-mixtral").expert_params * DTYPES[dtype].itemsize
        raw["emulated_link_gbps"] = emulated_link(link_bytes, reps * 3)
        raw["emulated_link_tiny_gbps"] = emulated_link(tiny, reps * 10)
    return raw


def _better(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per figure, the better of two passes (every figure here is a rate: higher is better)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            out[k] = {kk: max(vv, a[k].get(kk, vv)) for kk, vv in v.items()}
        elif isinstance(v, float) and isinstance(a.get(k), float):
            out[k] = max(v, a[k])
    return out


def _profile(raw: dict[str, Any], kind: str, dtype: str, name: str) -> HardwareProfile:
    cpu_rate = _best(raw["cpu_gemm_gflops"], dtype)
    common = {"name": name, "source": "measured", "cpu_gflops": round(cpu_rate, 1),
              "cpu_mem_gbps": round(raw["cpu_ram_gbps"], 2), "dtype": dtype,
              "dtype_rates": _dtype_rates(raw, kind, dtype), "notes": None}
    if kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        return HardwareProfile(
            **{**common, "notes": _notes(raw, kind, dtype, torch.cuda.get_device_name(0))},
            link=_pcie_link() or "PCIe (generation/width unknown: no NVML)",
            h2d_gbps=round(raw["cuda_links"]["h2d_pinned"], 2), d2h_gbps=round(raw["cuda_links"]["d2h_pinned"], 2),
            device_tflops=round(_best(raw["gpu_gemm_gflops"], dtype) / 1e3, 3),
            device_mem_gbps=round(raw["gpu_mem_gbps"], 1), device_memory_gib=round(props.total_memory / 2**30, 2))
    return HardwareProfile(
        **{**common, "notes": _notes(raw, kind, dtype, "cpu (emulated device)")},
        link="emulated (memcpy on the engine's copy worker thread)",
        h2d_gbps=round(raw["emulated_link_gbps"]["h2d"], 2), d2h_gbps=round(raw["emulated_link_gbps"]["d2h"], 2),
        device_tflops=round(cpu_rate / 1e3, 4), device_mem_gbps=round(raw["cpu_ram_gbps"], 2), device_memory_gib=None)


def _dtype_rates(raw: dict[str, Any], kind: str, dtype: str) -> dict[str, dict[str, float]]:
    """The measured dtype-dependent figures per dtype (profiles.RATE_FIGURES): GEMM rates of the
    dtypes other than the profile's own (those are the plain fields) and GEMV weight-read
    rates of every dtype; on the emulated device, the device's figures are the CPU's."""
    dev_gemm, dev_gemv = (raw["gpu_gemm_gflops"], raw["gpu_gemv_gbps"]) if kind == "cuda" else \
        (raw["cpu_gemm_gflops"], raw["cpu_gemv_gbps"])
    out: dict[str, dict[str, float]] = {}
    for dt in DTYPES:
        r: dict[str, float] = {}
        if dt != dtype:
            if any(k.startswith(dt + "@") for k in dev_gemm):
                r["device_tflops"] = round(_best(dev_gemm, dt) / 1e3, 4)
            if any(k.startswith(dt + "@") for k in raw["cpu_gemm_gflops"]):
                r["cpu_gflops"] = round(_best(raw["cpu_gemm_gflops"], dt), 1)
        if dt in dev_gemv:
            r["device_gemv_gbps"] = round(dev_gemv[dt], 2)
        if dt in raw["cpu_gemv_gbps"]:
            r["cpu_gemv_gbps"] = round(raw["cpu_gemv_gbps"][dt], 2)
        if r:
            out[dt] = r
    return out


def _best(rates: dict[str, float], dtype: str) -> float:
    vals = [v for k, v in rates.items() if k.startswith(dtype + "@")]
    if not vals:
        raise RuntimeError(f"no GEMM rate measured for dtype {dtype!r} (measured: {sorted(rates)})")
    return max(vals)


def _pcie_link() -> str | None:
    """The GPU's PCIe link from NVML (harness.manifest), or None. Max is what the slot and
    card negotiate under load; an idle link may sit at a lower current generation."""
    from harness.manifest import nvml_info
    n = nvml_info(None, 0)
    if n["pcie_gen_max"] is None:
        return None
    return (f"PCIe {n['pcie_gen_max']}.0 x{n['pcie_width_max']} (NVML max; current gen {n['pcie_gen_current']} "
            f"x{n['pcie_width_current']})")


def _fmt(d: dict[str, float] | None) -> str:
    return "n/a" if not d else ", ".join(f"{k} {v:.1f}" for k, v in d.items())


def _notes(raw: dict[str, Any], kind: str, dtype: str, device_name: str) -> str:
    parts = [f"Measured by `moebench calibrate` on {raw['cpu']} ({raw['cores']} logical CPUs; {device_name}), "
             f"torch {raw['torch']}, "
             f"{raw['torch_threads']} torch threads; figures are for {dtype}.",
             f"CPU GEMM GFLOP/s: {_fmt(raw['cpu_gemm_gflops'])}; CPU GEMV weight-read GB/s: {_fmt(raw['cpu_gemv_gbps'])}; "
             f"engine expert FFN ({dtype}): {_fmt(raw['cpu_expert'])}; RAM copy {raw['cpu_ram_gbps']:.1f} GB/s (read+write)."]
    parts.append(f"Per dtype: device_tflops and cpu_gflops are for {dtype}; dtype_rates holds the other dtypes' "
                 "GEMM rates and every dtype's GEMV weight-read GB/s.")
    if kind == "cuda":
        parts.append(f"GPU GEMM GFLOP/s: {_fmt(raw['gpu_gemm_gflops'])}; GPU GEMV GB/s: {_fmt(raw['gpu_gemv_gbps'])}; "
                     f"device copy {raw['gpu_mem_gbps']:.0f} GB/s "
                     f"(read+write); torch links GB/s: {_fmt(raw['cuda_links'])}; CuPy links GB/s: "
                     f"{_fmt(raw['cupy_links'])}. h2d/d2h = torch pinned (the engine's host store is pinned).")
    else:
        parts.append("EMULATED device: no GPU; device_tflops/device_mem_gbps are this CPU's own, and h2d/d2h are "
                     f"memcpy rates of a {LINK_EXPERT}-sized expert ({dtype}) -- h2d on the engine's copy worker "
                     f"thread, d2h a main-thread copy -- not a bus: {_fmt(raw['emulated_link_gbps'])}; "
                     f"tiny-mixtral expert size: {_fmt(raw['emulated_link_tiny_gbps'])}. device_memory_gib is null "
                     "(the emulated device has no memory of its own).")
    parts.append("Software overheads fitted on engine probes are in the .overheads.json beside this file.")
    return " ".join(parts)


# --- command line --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`moebench calibrate [--out PATH] [--quick] [--name NAME] [--dtype D] [--device D] [--threads N] [--no-fit]`."""
    ap = argparse.ArgumentParser(prog="moebench calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="profile yaml to write (default: conf/hardware/<name>.yaml)")
    ap.add_argument("--name", default=None, help="profile name (default: the --out file's stem, else 'measured')")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats (~10 s; for tests and CI)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the profile's figures")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--no-fit", action="store_true", help="skip the engine probes and the overhead fit")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads while measuring (default: torch's); the profile is for that setting")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.name or (Path(args.out).stem if args.out else "measured")
    out = Path(args.out) if args.out else PROFILE_DIR / f"{name}.yaml"
    t0 = time.perf_counter()
    profile, raw = measure(args.device, args.dtype, args.quick, name, fit=not args.no_fit)
    path = save_profile(profile, out)
    print(f"profile {profile.name!r} ({'emulated device' if profile.emulated else profile.link}) written to {path}"
          f" in {time.perf_counter() - t0:.1f} s")
    for key in ("h2d_gbps", "d2h_gbps", "device_tflops", "device_mem_gbps", "cpu_gflops", "cpu_mem_gbps"):
        print(f"  {key:<16} {getattr(profile, key)}")
    if not args.no_fit:
        o = profile.overheads
        print(f"  compute_scale {o.compute_scale:.3g}; overheads (us): "
              + ", ".join(f"{k} {v * 1e6:.3g}" for k, v in o.as_dict().items()))
        if o.info["fit_median_abs_rel_err"] > 0.15:
            print("  WARNING: the overhead fit is poor -- other processes were probably competing for the CPU; "
                  "rerun on a quieter machine (or with fewer torch threads, e.g. OMP_NUM_THREADS=1)")
        print(f"  fit: median |rel err| {o.info['fit_median_abs_rel_err']:.1%}, max {o.info['fit_max_abs_rel_err']:.1%} "
              f"over {o.info['probes'] - len(o.info['excluded'])} probes"
              + (f" (excluded as outliers: {', '.join(o.info['excluded'])})" if o.info["excluded"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
