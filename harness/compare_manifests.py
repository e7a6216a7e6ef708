"""What `moebench-compare` reads from job manifests, and the machine name baselines are filed under.

Owns: `read_manifests` (one row per job manifest: host, CPU, GPU, git commit, engine versions,
the model's identity and checkpoint path) and `machine_name` (the `results/baselines/<name>/`
dir of a machine). Does not own: the manifest's contents (harness.manifest), a model's identity
(harness.model_id), or how a comparison uses these facts (harness.compare).
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from harness.model_id import manifest_model_id
from harness.results import MANIFEST_FILE

log = logging.getLogger(__name__)

UNRECORDED = " (content not recorded)"     # a checkpoint's manifest without its content hash


def read_manifests(path: str | os.PathLike[str]) -> pd.DataFrame:
    """One row per job manifest under `path` (or beside a results file): the facts compare
    needs -- host, CPU, GPU, git commit, engine versions, the model's identity and checkpoint
    path -- keyed by (sweep_id, job_id)."""
    root = Path(path)
    # beside a results file: its job's manifest, or a sweep table's jobs' manifests in the dirs beside it
    files = sorted((root.parent if root.is_file() else root).rglob(MANIFEST_FILE))
    rows = []
    for file in files:
        try:
            m = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable manifest (%s); ignored", file, exc)
            continue
        if not isinstance(m, dict) or "sweep_id" not in m or "job_id" not in m:
            continue
        host, gpu, git, pkgs = (m.get(k) or {} for k in ("host", "gpu", "git", "packages"))
        model = (m.get("config") or {}).get("model") or {}
        path = model.get("path") if isinstance(model, Mapping) else None
        ident = manifest_model_id(m) or (f"checkpoint at {path}{UNRECORDED}" if path else None)
        rows.append({"sweep_id": str(m["sweep_id"]), "job_id": str(m["job_id"]),
                     "host": host.get("hostname"), "cpu_model": host.get("cpu_model"),
                     "cpu_cores": host.get("cpu_cores_available") or host.get("cpu_cores_logical"),
                     "platform": host.get("platform"), "arch": host.get("machine"),
                     "gpu_name": gpu.get("name"), "git_commit": git.get("commit"), "git_dirty": git.get("dirty"),
                     "schema_version": m.get("schema_version"), "moebench_version": pkgs.get("moebench"),
                     "transformers_version": pkgs.get("transformers"), "torch_version": pkgs.get("torch"),
                     "created": m.get("created"), "model_id": ident, "model_path": path})
    cols = ["sweep_id", "job_id", "host", "cpu_model", "cpu_cores", "platform", "arch", "gpu_name", "git_commit",
            "git_dirty", "schema_version", "moebench_version", "transformers_version", "torch_version", "created",
            "model_id", "model_path"]
    return pd.DataFrame(rows, columns=cols).drop_duplicates(["sweep_id", "job_id"]).reset_index(drop=True)


def machine_name(manifest: Mapping[str, Any] | None = None) -> str:
    """The directory name a baseline is filed under: OS, architecture, CPU model, available
    cores, and the GPU when there is one -- e.g. `linux-x86_64-amd-epyc-2c` or
    `linux-x86_64-amd-epyc-16c-nvidia-h200`. From a manifest row/dict (`read_manifests`
    columns or a raw manifest), or this machine when None."""
    if manifest is None:
        from harness.manifest import gpu_info, host_info
        host, gpu = host_info(), gpu_info()
        system, arch, cpu = platform.system(), host.get("machine"), host.get("cpu_model")
        cores, gpu_name = host.get("cpu_cores_available") or host.get("cpu_cores_logical"), gpu.get("name")
    elif "host" in manifest and isinstance(manifest["host"], Mapping):
        host, gpu = manifest["host"], manifest.get("gpu") or {}
        system, arch, cpu = str(host.get("platform") or "").split("-")[0], host.get("machine"), host.get("cpu_model")
        cores, gpu_name = host.get("cpu_cores_available") or host.get("cpu_cores_logical"), gpu.get("name")
    else:
        system, arch, cpu = str(manifest.get("platform") or "").split("-")[0], manifest.get("arch"), manifest.get("cpu_model")
        cores, gpu_name = manifest.get("cpu_cores"), manifest.get("gpu_name")
    known = lambda v: v is not None and not (isinstance(v, float) and math.isnan(v)) and v != ""  # noqa: E731
    parts = [system or "unknown-os", arch if known(arch) else "unknown-arch", _cpu_slug(cpu if known(cpu) else None)]
    if known(cores) and cores:
        parts.append(f"{int(cores)}c")
    if known(gpu_name):
        parts.append(str(gpu_name))
    return "-".join(p for p in (_slug(p) for p in parts) if p)


def _cpu_slug(cpu: str | None) -> str:
    if not cpu:
        return "unknown-cpu"
    cpu = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$|\bprocessor\b|\b\d+-core\b", " ", cpu, flags=re.IGNORECASE)
    return cpu


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", str(text).lower()).strip("-")
