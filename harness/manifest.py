"""The job manifest: everything needed to reproduce or judge a result (DESIGN.md §6, §7.9).

Owns: collecting the resolved config, creation time, git commit and dirty flag, package
versions and the engine's own builds (a llama-server's commit), Python, the environment
variables that change a measurement (`env`: thread pools, CUDA, torch's allocator;
`recorded_env`), host (CPU model, cores, RAM) and GPU (name, memory, driver, PCIe link via NVML)
into one JSON-serialisable dict.
Does not own: writing it (`harness.results.write_job` writes it atomically beside the
rows), or resolving the config (the caller passes the resolved dict, e.g.
`OmegaConf.to_container(cfg, resolve=True)`).

    from harness.manifest import collect_manifest
    manifest = collect_manifest(resolved_config, extra={"sweep_id": "s1", "job_id": "0"})

Never raises for a missing tool or library: no git, not a repository, no CUDA, no NVML,
no /proc — the field is None (null). On a CPU-only machine every GPU field except
`count` (0) is None. GPU facts come through torch.cuda, so on CUDA this initialises the
CUDA context: call it in the job process, not in a parent that forks workers later.
PCIe "current" generation/width is what the link runs at when sampled (GPUs lower it
when idle); the "max" fields say what the link can do.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.results import SCHEMA_VERSION

log = logging.getLogger(__name__)

REPO_DIR = Path(__file__).resolve().parent.parent
PACKAGES = ("moebench", "torch", "transformers", "safetensors", "numpy", "pandas", "pyarrow",
            "hydra-core", "omegaconf", "psutil", "nvidia-ml-py")
GPU_FIELDS = ("count", "index", "name", "uuid", "memory_bytes", "compute_capability",
              "cuda_runtime", "driver_version", "pcie_gen_current", "pcie_width_current",
              "pcie_gen_max", "pcie_width_max")
MANIFEST_KEYS = ("schema_version", "created", "config", "git", "packages", "engine_builds", "python", "env", "host",
                 "gpu")
# Environment variables that change what a job measures, so `moebench rerun` sets them again: the
# thread pools of the OpenMP and BLAS runtimes under torch and llama.cpp (they read these once, when
# the library loads), CUDA's device selection and numerics, torch's allocator and CPU kernel
# dispatch, and which llama.cpp build runs. moebench's own MOEBENCH_NSYS_CHILD (a marker for the
# process it re-launches) and MOEBENCH_RESULTS (the notebooks') change no measurement.
ENV_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG",
                       "NVIDIA_TF32_OVERRIDE", "ATEN_CPU_CAPABILITY", "LLAMA_CPP_BIN", "MOEBENCH_CACHE"})
ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "VECLIB_", "NUMEXPR_", "DNNL_", "ONEDNN_", "PYTORCH_")
_GIT_TIMEOUT_S = 10


def collect_manifest(resolved_config: Mapping[str, Any], extra: Mapping[str, Any] | None = None, *,
                     repo_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The manifest of one job; `extra` keys (e.g. sweep_id, job_id) are added at top level.

    `repo_dir` is where git is asked for the commit (default: this checkout).
    """
    if not isinstance(resolved_config, Mapping):
        raise TypeError(f"resolved_config must be a mapping (e.g. OmegaConf.to_container(cfg, "
                        f"resolve=True)); got {type(resolved_config).__name__}")
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(),
        "config": _jsonable(resolved_config),
        "git": git_info(REPO_DIR if repo_dir is None else Path(repo_dir)),
        "packages": package_versions(),
        "engine_builds": engine_builds(resolved_config),
        "python": {"version": platform.python_version(),
                   "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "env": recorded_env(),
        "host": host_info(),
        "gpu": gpu_info(),
    }
    if extra:
        clash = sorted(set(extra) & set(manifest))
        if clash:
            raise ValueError(f"extra keys {clash} would overwrite manifest fields; "
                             f"reserved: {list(MANIFEST_KEYS)}")
        manifest.update(_jsonable(dict(extra)))
    return manifest


# ----------------------------------------------------------------------------- git

def _git(repo_dir: Path, *args: str) -> str | None:
    """stdout of a read-only git command, or None (no git, not a repo, any failure)."""
    # --no-optional-locks: never take index.lock, so this cannot break a concurrent commit.
    cmd = ["git", "--no-optional-locks", *args]
    try:
        proc = subprocess.run(cmd, cwd=repo_dir, capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("%s in %s failed: %s", " ".join(cmd), repo_dir, exc)
        return None
    if proc.returncode != 0:
        log.debug("%s in %s exited %d: %s", " ".join(cmd), repo_dir, proc.returncode,
                  proc.stderr.strip())
        return None
    return proc.stdout


def git_info(repo_dir: Path) -> dict[str, Any]:
    """{"commit": sha | None, "dirty": bool | None, "root": path | None}."""
    commit = _git(repo_dir, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "root": None}
    status = _git(repo_dir, "status", "--porcelain")
    root = _git(repo_dir, "rev-parse", "--show-toplevel")
    return {"commit": commit.strip() or None,
            "dirty": None if status is None else bool(status.strip()),
            "root": None if root is None else root.strip() or None}


# ----------------------------------------------------------------------------- packages

def package_versions() -> dict[str, str | None]:
    """Installed distribution versions (None when not installed); read from metadata, not imports."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    if versions["moebench"] is None:  # running from a checkout that was not pip-installed
        versions["moebench"] = _checkout_version()
    return versions


def engine_name(resolved_config: Mapping[str, Any]) -> str | None:
    """The config's engine (`engine.name`; a plain `engine` value in an older config)."""
    engine = resolved_config.get("engine")
    name = engine.get("name") if isinstance(engine, Mapping) else engine
    return str(name) if name else None


def engine_builds(resolved_config: Mapping[str, Any]) -> dict[str, str] | None:
    """What the config's engine runs beside the Python packages (`EngineAdapter.builds`: a
    llama-server's commit); {} when nothing, None when it cannot be told (no such engine, no build)."""
    name = engine_name(resolved_config)
    if not name:
        return None
    try:
        from harness.engines import ENGINES
        return dict(ENGINES.get(name).builds())
    except Exception as exc:  # noqa: BLE001 -- a manifest never fails its job; the engine reports its own errors
        log.debug("engine %s: builds unknown: %s", name, exc)
        return None


def _checkout_version() -> str | None:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return None
    try:
        project = tomllib.loads((REPO_DIR / "pyproject.toml").read_text()).get("project", {})
    except (OSError, ValueError):
        return None
    return project.get("version") if project.get("name") == "moebench" else None


# ----------------------------------------------------------------------------- environment

def env_recorded(name: str) -> bool:
    """Whether a manifest records the environment variable `name` (ENV_NAMES, ENV_PREFIXES)."""
    return name in ENV_NAMES or name.startswith(ENV_PREFIXES)


def recorded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The recorded variables that are set, sorted by name; one the rule names but that is
    absent was unset when the job ran."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if env_recorded(k)}


# ----------------------------------------------------------------------------- host

def host_info() -> dict[str, Any]:
    """Hostname, OS, CPU model and core counts, RAM bytes."""
    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        available = None
    physical = ram = None
    try:
        import psutil
        physical = psutil.cpu_count(logical=False)
        ram = int(psutil.virtual_memory().total)
    except (ImportError, OSError, RuntimeError) as exc:
        log.debug("psutil unavailable: %s", exc)
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "machine": platform.machine(), "cpu_model": cpu_model(),
            "cpu_cores_logical": os.cpu_count(), "cpu_cores_physical": physical,
            "cpu_cores_available": available, "ram_bytes": ram}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("model name", "Hardware", "Processor", "cpu model"):  # x86, then ARM/others
        match = re.search(rf"^{key}\s*:\s*(.+?)\s*$", text, re.MULTILINE)
        if match:
            return match.group(1)
    return platform.processor() or None


# ----------------------------------------------------------------------------- gpu

def gpu_info() -> dict[str, Any]:
    """The current CUDA device: name, memory, driver, PCIe link. All None (count 0) without CUDA."""
    info: dict[str, Any] = dict.fromkeys(GPU_FIELDS)
    info["count"] = 0
    try:
        import torch
    except ImportError:
        return info
    try:
        if not torch.cuda.is_available():
            return info
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        info.update(count=torch.cuda.device_count(), index=index, name=props.name,
                    uuid=None if uuid is None else str(uuid),
                    memory_bytes=int(props.total_memory),
                    compute_capability=f"{props.major}.{props.minor}",
                    cuda_runtime=torch.version.cuda)
    except (RuntimeError, AssertionError, AttributeError) as exc:
        log.warning("CUDA is available but its device properties could not be read: %s", exc)
        return info
    info.update(nvml_info(info["uuid"], index))
    if info["driver_version"] is None:
        info["driver_version"] = _driver_from_proc()
    return info


def nvml_info(uuid: str | None, index: int) -> dict[str, Any]:
    """Driver version and PCIe link of one GPU via NVML (pynvml); Nones when NVML is missing."""
    out: dict[str, Any] = {"driver_version": None, "pcie_gen_current": None,
                           "pcie_width_current": None, "pcie_gen_max": None, "pcie_width_max": None}
    try:
        import pynvml
    except ImportError:
        log.debug("pynvml (nvidia-ml-py) not installed; no driver/PCIe facts")
        return out
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML init failed: %s", exc)
        return out
    try:
        out["driver_version"] = _text(pynvml.nvmlSystemGetDriverVersion())
        handle = _nvml_handle(pynvml, uuid, index)
        queries = {"pcie_gen_current": "nvmlDeviceGetCurrPcieLinkGeneration",
                   "pcie_width_current": "nvmlDeviceGetCurrPcieLinkWidth",
                   "pcie_gen_max": "nvmlDeviceGetMaxPcieLinkGeneration",
                   "pcie_width_max": "nvmlDeviceGetMaxPcieLinkWidth"}
        for key, fn in queries.items():
            try:
                out[key] = int(getattr(pynvml, fn)(handle))
            except (pynvml.NVMLError, AttributeError) as exc:
                log.debug("NVML %s failed: %s", fn, exc)
    except pynvml.NVMLError as exc:
        log.debug("NVML query failed: %s", exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return out


def _nvml_handle(pynvml: Any, uuid: str | None, index: int) -> Any:
    """The NVML handle of torch's device `index` (NVML ignores CUDA_VISIBLE_DEVICES)."""
    if uuid:
        nvml_uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(nvml_uuid)
        except pynvml.NVMLError as exc:
            log.debug("NVML handle by uuid %s failed: %s", nvml_uuid, exc)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index < len(visible):
        if visible[index].isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(visible[index]))
        return pynvml.nvmlDeviceGetHandleByUUID(visible[index])
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _driver_from_proc(path: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    try:
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", path.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ----------------------------------------------------------------------------- json

def _jsonable(obj: Any) -> Any:
    """A JSON-safe copy: mappings/sequences recursed, paths and enums as text, NaN/inf as None."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (Sequence, set, frozenset)) and not isinstance(obj, (bytes, bytearray)):
        return [_jsonable(v) for v in obj]  # lists, tuples, OmegaConf ListConfig
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, enum.Enum):
        return _jsonable(obj.value)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        try:
            return _jsonable(obj.item())
        except (TypeError, ValueError):
            pass
    return str(obj)
