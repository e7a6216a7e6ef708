"""Import llama-bench results (`-o json` or `-o jsonl`) as tidy rows plus a manifest.

Owns: reading llama-bench's output, mapping each test to a moebench phase, its raw samples to
repeats, its knobs to columns, and its build/machine info to the manifest. Does not own: the
row schema (`harness.results`), running llama-bench, or the CLI wiring
(`moebench import llama-bench FILE` calls `main`).

A file is a sweep and each test record in it a job (`<job_id>-<i>`, i its place in the file), as
llama-bench runs every knob combination and test shape as its own record: `-t 1,2 -p 512 -n 128`
gives four jobs, so no table, comparison or plot pools two settings, and repeats stay each
record's own samples.

    jobs = import_file("bench.jsonl", sweep_id="llama-bench", job_id="b0")   # [(rows, manifest), ...]
    main(["bench.jsonl", "--out", sweep_dir])        # sweep_dir/<i>/rows.parquet, then the sweep table

Mapping (DESIGN §5/§6), one row per metric per sample:
  * `pp` test (n_prompt > 0, n_gen = 0): phase `prefill_fresh`, or `prefill_continuation` when
    llama-bench ran it at a depth (`-d N`: N tokens already in the KV; `reused_tokens` = N).
  * `tg` test (n_gen > 0, n_prompt = 0): phase `decode` (starting at context n_depth).
  * `pg` tests (prompt and generation in one timing) fit no single phase: skipped, with a warning.
  * metrics per sample i (repeat = i): `tok_per_s` = samples_ts[i], `time_s` = samples_ns[i]/1e9,
    `tokens` = n_prompt or n_gen; source=engine (llama-bench times itself). Nothing llama-bench
    does not measure is emitted (no bytes, no hit rates, no memory peaks: absent, never 0).
  * columns: engine=llamacpp, token_source=random (llama-bench feeds random ids), every knob
    (the `flags.KNOB_COLUMNS` names where one exists, llama-bench's own names otherwise:
    `flags.BENCH_ONLY_KNOBS`), as a moebench llama.cpp run names them: `gguf_type` the weights'
    file type from `model_type` in llama-quantize's spelling ("Q4_K - Medium" -> q4_k_m, "all F32"
    -> f32), `dtype` the model dtype that type stores as it is (f32 -> float32; null for a
    quantised type, whose source dtype the file does not say), `override_tensor` null where
    llama-bench says "none". Knobs llama-bench reports at their effective value (n_cpu_moe 0,
    n_gpu_layers -1, type_k f16, ...) stay so; a moebench run's null there means llama.cpp's
    default was not overridden.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.llamacpp.flags import BENCH_ONLY_KNOBS, OWN_TYPES
from harness.results import make_rows

log = logging.getLogger(__name__)

# llama-bench field -> column (the same names flags.LlamaFlags.as_factors gives the knobs)
KNOB_FIELDS = {"n_gpu_layers": "n_gpu_layers", "n_cpu_moe": "n_cpu_moe", "tensor_buft_overrides": "override_tensor",
               "n_ubatch": "ubatch", "n_batch": "n_batch", "type_k": "cache_type_k", "type_v": "cache_type_v",
               "flash_attn": "flash_attn", "n_threads": "threads"}
FTYPE_SIZES = {"Small": "s", "Medium": "m", "Large": "l"}      # "Q4_K - Medium" is llama-quantize's Q4_K_M
BUILD_FIELDS = ("build_commit", "build_number", "backends", "cpu_info", "gpu_info")
FLASH_ATTN = {1: "on", 0: "off", -1: "auto", True: "on", False: "off"}
NOT_GIVEN = {"tensor_buft_overrides": ("", "none")}           # llama-bench's spelling of no value (else "")
STORED_AS = {t: dtype for dtype, t in OWN_TYPES.items()}        # f32 -> float32: a file type that is a model dtype


class BenchImportError(ValueError):
    """A file that is not llama-bench JSON/JSONL output, or a test that cannot be imported."""


def read_records(path: Path | str) -> list[dict[str, Any]]:
    """The test records of a llama-bench `-o json` (one array) or `-o jsonl` (one per line) file."""
    path = Path(path)
    text = path.read_text()
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            records = json.loads(stripped)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise BenchImportError(f"{path}: not llama-bench -o json/jsonl output ({e})") from e
    if not records or not all(isinstance(r, dict) and "samples_ts" in r for r in records):
        raise BenchImportError(f"{path}: expected llama-bench test records with 'samples_ts' "
                               f"(from `llama-bench -o json` or `-o jsonl`); got {str(records)[:200]}")
    return records


def phase_of(rec: Mapping[str, Any]) -> str | None:
    n_prompt, n_gen, depth = int(rec.get("n_prompt", 0)), int(rec.get("n_gen", 0)), int(rec.get("n_depth", 0) or 0)
    if n_prompt > 0 and n_gen == 0:
        return "prefill_continuation" if depth > 0 else "prefill_fresh"
    if n_gen > 0 and n_prompt == 0:
        return "decode"
    return None


def factors_of(rec: Mapping[str, Any]) -> dict[str, Any]:
    n_prompt, n_gen, depth = int(rec.get("n_prompt", 0)), int(rec.get("n_gen", 0)), int(rec.get("n_depth", 0) or 0)
    model_type = str(rec.get("model_type", ""))
    ftype = file_type(model_type)
    f: dict[str, Any] = {
        "engine": "llamacpp", "model": Path(str(rec.get("model_filename", ""))).name or None,
        "placement": None, "cache_capacity": None, "cache_policy": None, "prefetch": None,
        "workload": "llama-bench", "context_tokens": depth + (n_prompt if n_prompt else 0),
        "gen_tokens": n_gen, "batch": 1, "gguf_type": ftype, "dtype": STORED_AS.get(ftype),
        "token_source": "random", "model_type": model_type or None, "model_size_bytes": rec.get("model_size"),
        "model_n_params": rec.get("model_n_params"), "n_depth": depth,
        "test": f"pp{n_prompt}" if n_prompt and not n_gen else f"tg{n_gen}" if n_gen and not n_prompt
        else f"pp{n_prompt}+tg{n_gen}",
    }
    for field, col in KNOB_FIELDS.items():
        if field in rec:
            v = rec[field]
            f[col] = FLASH_ATTN.get(v, v) if field == "flash_attn" else (None if v in NOT_GIVEN.get(field, ("",)) else v)
    if "cache_type_k" in f or "cache_type_v" in f:
        k, v = f.get("cache_type_k"), f.get("cache_type_v")
        f["kv_dtype"] = k if k == v else f"{k}/{v}"
    for field in BENCH_ONLY_KNOBS:
        if field in rec:
            f[field] = rec[field] if rec[field] != "" else None
    return f


def file_type(model_type: str) -> str | None:
    """The weights' file type in a llama-bench `model_type` ("<arch> <size> <ftype name>", the
    name as llama.cpp's llama_ftype_name spells it), lower-case as llama-quantize names it:
    "mixtral 8x7B Q4_K - Medium" -> q4_k_m, "llama ?B all F32" -> f32, "... IQ2_XS - 2.3125 bpw"
    -> iq2_xs, "... MXFP4 MoE" -> mxfp4_moe. None when it has no such part."""
    parts = model_type.split(" ", 2)
    if len(parts) < 3:
        return None
    name = parts[2].removeprefix("(guessed) ").removeprefix("all ")
    head, _, tail = name.partition(" - ")
    size = FTYPE_SIZES.get(tail.split(" ")[0]) if tail else None
    return "_".join([*head.split(), *([size] if size else [])]).lower()


def device_of(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The device columns from llama-bench's `backends` ("CPU", "CUDA", "BLAS,CPU", ...)."""
    backends = [b.strip() for b in str(rec.get("backends", "")).split(",") if b.strip()]
    accel = [b for b in backends if b not in ("CPU", "BLAS")]
    kind = "cuda" if "CUDA" in accel else (accel[0].lower() if accel else "cpu")
    name = rec.get("gpu_info") if accel else rec.get("cpu_info")
    return {"device_kind": kind, "device_name": name or None, "emulated": False}


def rows_of(rec: Mapping[str, Any], sweep_id: str, job_id: str) -> list[dict[str, Any]]:
    phase = phase_of(rec)
    if phase is None:
        log.warning("skipping llama-bench test n_prompt=%s n_gen=%s: prompt and generation are timed together, "
                    "which no single phase describes", rec.get("n_prompt"), rec.get("n_gen"))
        return []
    ts, ns = list(rec.get("samples_ts") or []), list(rec.get("samples_ns") or [])
    if ns and len(ns) != len(ts):
        raise BenchImportError(f"llama-bench record has {len(ts)} samples_ts but {len(ns)} samples_ns")
    tokens = int(rec["n_prompt"] if phase != "decode" else rec["n_gen"])
    depth = int(rec.get("n_depth", 0) or 0)
    factors, device = factors_of(rec), device_of(rec)
    rows: list[dict[str, Any]] = []
    for i, tps in enumerate(ts):
        metrics: dict[str, float | None] = {"tok_per_s": float(tps), "tokens": tokens}
        if ns:
            metrics["time_s"] = float(ns[i]) / 1e9
        if phase == "prefill_continuation":
            metrics["reused_tokens"] = depth
        rows += make_rows(factors, device, sweep_id, job_id, i, phase, metrics, "engine")
    return rows


def import_file(path: Path | str, *, sweep_id: str = "llama-bench", job_id: str | None = None
                ) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(rows, manifest) of each job of one llama-bench output file: one per test record it can
    import, job id `<job_id>-<i>` (default job_id: the file's sha256, 12 hex digits; i: the
    record's place in the file)."""
    path = Path(path)
    data = path.read_bytes()
    job_id = job_id or hashlib.sha256(data).hexdigest()[:12]
    records = read_records(path)
    jobs = []
    for i, rec in enumerate(records):
        rows = rows_of(rec, sweep_id, f"{job_id}-{i}")
        if rows:
            jobs.append((rows, _manifest(path, data, rec, i, len(records), sweep_id, f"{job_id}-{i}")))
    if not jobs:
        raise BenchImportError(f"{path}: no pp or tg test to import ({len(records)} records, all skipped)")
    return jobs


def _manifest(path: Path, data: bytes, rec: Mapping[str, Any], index: int, n_records: int, sweep_id: str,
              job_id: str) -> dict[str, Any]:
    from harness.manifest import collect_manifest   # the importing machine; llama-bench's is in `llama_bench`

    return collect_manifest(
        {"import": "llama-bench", "file": str(path.resolve()), "record": index},
        extra={"sweep_id": sweep_id, "job_id": job_id,
               "llama_bench": {"file": str(path.resolve()), "sha256": hashlib.sha256(data).hexdigest(),
                               "record": index, "records": n_records,
                               "build": {k: rec.get(k) for k in BUILD_FIELDS}, "test_time": rec.get("test_time")}})


def main(argv: Sequence[str] | None = None) -> int:
    """`moebench import llama-bench FILE [--out SWEEP_DIR]`: one job dir per test record
    (rows.parquet + manifest.json), then the sweep's table and summary."""
    from harness.results import ResultsError, write_job, write_sweep

    ap = argparse.ArgumentParser(prog="moebench import llama-bench", description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="llama-bench output from -o json or -o jsonl")
    ap.add_argument("--out", type=Path, default=None,
                    help="sweep dir to write, one job dir per test record "
                         "(default: results/llama-bench/<sha256 of the file, 12 hex digits>)")
    ap.add_argument("--sweep-id", default="llama-bench")
    ap.add_argument("--job-id", default=None, help="job id prefix (default: the file's sha256, 12 hex digits)")
    args = ap.parse_args(argv)
    try:
        jobs = import_file(args.file, sweep_id=args.sweep_id, job_id=args.job_id)
        out = args.out or Path("results") / "llama-bench" / jobs[0][1]["llama_bench"]["sha256"][:12]
        for rows, manifest in jobs:
            write_job(out / str(manifest["llama_bench"]["record"]), rows, manifest)
        write_sweep(out)
    except (OSError, BenchImportError, ResultsError) as e:
        print(f"moebench import llama-bench: {e}", file=sys.stderr)
        return 1
    print(f"{sum(len(r) for r, _ in jobs)} rows from {args.file}: {len(jobs)} jobs (one per test) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
