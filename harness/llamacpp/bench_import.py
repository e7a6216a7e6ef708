"""Import llama-bench results (`-o json` or `-o jsonl`) as tidy rows plus a manifest.

Owns: reading llama-bench's output, mapping each test to a moebench phase, its raw samples to
repeats, its knobs to columns, and its build/machine info to the manifest. Does not own: the
row schema (`harness.results`), running llama-bench, or the CLI wiring
(`moebench import llama-bench FILE` calls `main`).

    rows, manifest = import_file("bench.jsonl", sweep_id="llama-bench", job_id="0")
    write_job(job_dir, rows, manifest)               # or: main(["bench.jsonl", "--out", job_dir])

Mapping (DESIGN §5/§6), one row per metric per sample:
  * `pp` test (n_prompt > 0, n_gen = 0): phase `prefill_fresh`, or `prefill_continuation` when
    llama-bench ran it at a depth (`-d N`: N tokens already in the KV; `reused_tokens` = N).
  * `tg` test (n_gen > 0, n_prompt = 0): phase `decode` (starting at context n_depth).
  * `pg` tests (prompt and generation in one timing) fit no single phase: skipped, with a warning.
  * metrics per sample i (repeat = i): `tok_per_s` = samples_ts[i], `time_s` = samples_ns[i]/1e9,
    `tokens` = n_prompt or n_gen; source=engine (llama-bench times itself). Nothing llama-bench
    does not measure is emitted (no bytes, no hit rates, no memory peaks: absent, never 0).
  * columns: engine=llamacpp, token_source=random (llama-bench feeds random ids), every knob
    (the `flags.KNOB_COLUMNS` names where one exists, llama-bench's own names otherwise).
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

from harness.results import make_rows

log = logging.getLogger(__name__)

# llama-bench field -> column (the same names flags.LlamaFlags.as_factors gives the knobs)
KNOB_FIELDS = {"n_gpu_layers": "n_gpu_layers", "n_cpu_moe": "n_cpu_moe", "tensor_buft_overrides": "override_tensor",
               "n_ubatch": "ubatch", "n_batch": "n_batch", "type_k": "cache_type_k", "type_v": "cache_type_v",
               "flash_attn": "flash_attn", "n_threads": "threads"}
# the remaining llama-bench knobs, kept under their own names
OTHER_KNOBS = ("cpu_mask", "cpu_strict", "poll", "split_mode", "main_gpu", "no_kv_offload", "devices",
               "tensor_split", "load_mode", "lazy_mode", "use_mmap", "use_direct_io", "embeddings",
               "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx")
BUILD_FIELDS = ("build_commit", "build_number", "backends", "cpu_info", "gpu_info")
FLASH_ATTN = {1: "on", 0: "off", -1: "auto", True: "on", False: "off"}


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
    f: dict[str, Any] = {
        "engine": "llamacpp", "model": Path(str(rec.get("model_filename", ""))).name or None,
        "placement": None, "cache_capacity": None, "cache_policy": None, "prefetch": None,
        "workload": "llama-bench", "context_tokens": depth + (n_prompt if n_prompt else 0),
        "gen_tokens": n_gen, "batch": 1, "dtype": model_type.split()[-1].lower() if model_type else None,
        "token_source": "random", "model_type": model_type or None, "model_size_bytes": rec.get("model_size"),
        "model_n_params": rec.get("model_n_params"), "n_depth": depth,
        "test": f"pp{n_prompt}" if n_prompt and not n_gen else f"tg{n_gen}" if n_gen and not n_prompt
        else f"pp{n_prompt}+tg{n_gen}",
    }
    for field, col in KNOB_FIELDS.items():
        if field in rec:
            v = rec[field]
            f[col] = FLASH_ATTN.get(v, v) if field == "flash_attn" else (v if v != "" else None)
    if "cache_type_k" in f or "cache_type_v" in f:
        k, v = f.get("cache_type_k"), f.get("cache_type_v")
        f["kv_dtype"] = k if k == v else f"{k}/{v}"
    for field in OTHER_KNOBS:
        if field in rec:
            f[field] = rec[field] if rec[field] != "" else None
    return f


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
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and manifest for one llama-bench output file (one job)."""
    path = Path(path)
    data = path.read_bytes()
    job_id = job_id or hashlib.sha256(data).hexdigest()[:12]
    records = read_records(path)
    rows = [r for rec in records for r in rows_of(rec, sweep_id, job_id)]
    if not rows:
        raise BenchImportError(f"{path}: no pp or tg test to import ({len(records)} records, all skipped)")
    builds = sorted({json.dumps({k: rec.get(k) for k in BUILD_FIELDS}, sort_keys=True) for rec in records})
    manifest = _manifest(path, data, records, [json.loads(b) for b in builds], sweep_id, job_id)
    return rows, manifest


def _manifest(path: Path, data: bytes, records: list[dict], builds: list[dict], sweep_id: str,
              job_id: str) -> dict[str, Any]:
    from harness.manifest import collect_manifest   # the importing machine; llama-bench's is in `llama_bench`

    return collect_manifest(
        {"import": "llama-bench", "file": str(path.resolve())},
        extra={"sweep_id": sweep_id, "job_id": job_id,
               "llama_bench": {"file": str(path.resolve()), "sha256": hashlib.sha256(data).hexdigest(),
                               "records": len(records), "build": builds[0] if len(builds) == 1 else builds,
                               "test_times": sorted({str(r.get("test_time")) for r in records})}})


def main(argv: Sequence[str] | None = None) -> int:
    """`moebench import llama-bench FILE [--out JOB_DIR]`: write rows.parquet + manifest.json."""
    from harness.results import write_job

    ap = argparse.ArgumentParser(prog="moebench import llama-bench", description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="llama-bench output from -o json or -o jsonl")
    ap.add_argument("--out", type=Path, default=None,
                    help="job dir to write (default: results/llama-bench/<sha256 of the file>)")
    ap.add_argument("--sweep-id", default="llama-bench")
    ap.add_argument("--job-id", default=None, help="default: the file's sha256, 12 hex digits")
    args = ap.parse_args(argv)
    try:
        rows, manifest = import_file(args.file, sweep_id=args.sweep_id, job_id=args.job_id)
    except (OSError, BenchImportError) as e:
        print(f"moebench import llama-bench: {e}", file=sys.stderr)
        return 1
    out = args.out or Path("results") / "llama-bench" / manifest["job_id"]
    write_job(out, rows, manifest)
    print(f"{len(rows)} rows from {args.file} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
