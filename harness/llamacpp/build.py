"""The pinned llama.cpp build: fetch, extract, configure, compile, find.

Owns: the cmake flags the pinned tree is built with, where the build lives (the cache, outside
the repo), when a build counts as finished (a marker written last), and finding the binaries
afterwards. Does not own: which llama.cpp is measured and fetching it (`source`: the tree
vendored in one pinned, hash-checked `llama-cpp-python` sdist from PyPI; its names are
re-exported here), converting weights (`convert`), running the server (`server`) or the knobs
passed to it (`flags`).

Cache layout, under `cache_root()` = `$MOEBENCH_CACHE` or `~/.cache/moebench`:

    llama.cpp/downloads/llama_cpp_python-<v>.tar.gz   the sdist, sha256-checked
    llama.cpp/src-<v>/                                its vendor/llama.cpp tree (+ CHANGELOG.md)
    llama.cpp/<v>-<flags hash>/build/                 the cmake binary dir
    llama.cpp/<v>-<flags hash>/build.log              configure + compile output
    llama.cpp/<v>-<flags hash>/BUILD_OK.json          written last: a build without it is not trusted

    python -m harness.llamacpp.build [--cuda auto|on|off] [--jobs N]
    bins = find_binaries()          # Binaries(server=Path, bench=Path, quantize=Path|None, info=...)

A build killed half-way has no marker, so the next run builds again; with Ninja it resumes
(Ninja re-runs every step it has no log entry for), with another generator the build dir is
wiped first. Concurrent builds of the same flags are serialised by a lock file.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TextIO

# the pin, the cache and the extracted tree (also read as `build.cache_root()`, `build.source_dir()`, ...)
from harness.llamacpp.source import (LLAMA_CPP_PYTHON_VERSION, SDIST_SHA256, LlamaCppBuildError,  # noqa: F401
                                     cache_root, llamacpp_root, source_dir, vendored_commit)

log = logging.getLogger(__name__)

# What moebench runs: the server, the bench tool, and the quantizer (GGUF types the Python
# converter cannot write, e.g. q4_k_m). Nothing else of the tree is compiled.
TARGETS = ("llama-server", "llama-bench", "llama-quantize")
REQUIRED = ("llama-server", "llama-bench")

MARKER = "BUILD_OK.json"
CUDA_CHOICES = ("auto", "on", "off")

# Why each flag (DESIGN: a build from the registries only, reproducible):
#   CMAKE_BUILD_TYPE=Release          optimised, as users run it
#   BUILD_SHARED_LIBS=OFF             self-contained binaries: no rpath into the build dir
#   GGML_NATIVE=ON                    tuned to this CPU (the cache is per machine); recorded
#   LLAMA_BUILD_TESTS/EXAMPLES/APP=OFF  not needed; fewer sources configured
#   LLAMA_BUILD_TOOLS/SERVER=ON       llama-server, llama-bench, llama-quantize live there
#   LLAMA_BUILD_UI=OFF                no npm build of the web UI
#   LLAMA_USE_PREBUILT_UI=OFF         no download of prebuilt UI assets at build time; the
#                                     server is built with an empty UI table (API only)
#   LLAMA_OPENSSL=OFF                 no HTTPS model downloads (-hf); models come from disk
#   LLAMA_LLGUIDANCE=OFF              would fetch a Rust project at build time
#   GGML_CCACHE=OFF                   reproducible, no hidden state from another tree
#   LLAMA_BUILD_COMMIT=<commit>       the sdist has no .git; the commit its CHANGELOG names
#                                     is what `--version` and llama-bench's build_commit report
#   GGML_CUDA=ON|OFF                  the backend
#   CMAKE_C/CXX_FLAGS=-mno-amx-*      only where the CPU reports AMX but cannot run it (`amx_broken`)
BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DGGML_CCACHE=OFF",
)


class BinaryFailed(LlamaCppBuildError):
    """A llama.cpp binary did not run: it could not be started, or exited non-zero where it must not
    (its --help). One line: the command, its exit status and the tail of what it printed."""


def run_binary(binary: Path, args: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """`binary args` to its end; BinaryFailed when it cannot start, outlasts `timeout` or exits non-zero."""
    cmd = f"{binary} {' '.join(args)}"
    try:
        proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout)
    except OSError as exc:
        raise BinaryFailed(f"{cmd} could not start ({exc}); {RUN_HINT}") from None
    except subprocess.TimeoutExpired:
        raise BinaryFailed(f"{cmd} did not finish within {timeout:.0f} s; {RUN_HINT}") from None
    if proc.returncode != 0:
        status = f"exit {proc.returncode}" if proc.returncode > 0 else f"killed by signal {-proc.returncode}"
        lines = [ln.strip() for ln in (proc.stderr.strip() or proc.stdout).splitlines() if ln.strip()]
        tail = " | ".join(lines[-3:])[-400:] or "it printed nothing"
        raise BinaryFailed(f"{cmd} failed ({status}): {tail}; {RUN_HINT}")
    return proc


# GCC gives an explicit -mno-* precedence over -march=native whatever the order
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


@dataclass(frozen=True)
class BuildConfig:
    """What decides the binaries (hashed into the build dir name); `jobs` does not.
    `no_amx`: compile without AMX although the CPU reports it (see `amx_broken`)."""
    cuda: bool = False
    no_amx: bool = False
    jobs: int = field(default=0, compare=False)   # 0: os.cpu_count()

    def cmake_flags(self, commit: str) -> list[str]:
        flags = [*BASE_FLAGS, f"-DLLAMA_BUILD_COMMIT={commit}", f"-DGGML_CUDA={'ON' if self.cuda else 'OFF'}"]
        if self.no_amx:
            flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
        return flags

    def flags_hash(self, commit: str) -> str:
        text = "\n".join([SDIST_SHA256, *self.cmake_flags(commit), *TARGETS])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def backend(self) -> str:
        return "cuda" if self.cuda else "cpu"


@dataclass(frozen=True)
class BuildInfo:
    """The marker's content: what was built, from what, how, how long it took."""
    llama_cpp_python: str
    llama_cpp_commit: str
    backend: str
    cmake_flags: list[str]
    targets: list[str]
    build_dir: str
    elapsed_s: float
    jobs: int
    built_at: str
    compiler: str

    @classmethod
    def read(cls, path: Path) -> BuildInfo:
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class Binaries:
    """Where llama-server/llama-bench (and llama-quantize, when built) are, and the build's
    record when they came from the cache (None for LLAMA_CPP_BIN or PATH)."""
    server: Path
    bench: Path
    quantize: Path | None
    info: BuildInfo | None
    origin: str                       # "cache" | "LLAMA_CPP_BIN" | "PATH"


# ---------------------------------------------------------------- build


@lru_cache(maxsize=1)
def detect_cuda() -> bool:
    """True when this machine can build and run CUDA: nvcc and a visible NVIDIA GPU."""
    nvcc = shutil.which("nvcc") or (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
    if not Path(nvcc).is_file():
        return False
    if Path("/dev/nvidia0").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True)
        return out.returncode == 0 and "GPU" in out.stdout
    return False


# A few AMX instructions; exit 0 only if this machine executes them.
_AMX_PROBE = r"""
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;          /* palette 1; tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""


@lru_cache(maxsize=1)
def amx_broken() -> bool:
    """True when the CPU reports AMX but executing it fails. Seen on VMs whose hypervisor passes
    the CPUID bits through without enabling the tile state: `-march=native` then compiles
    ggml's AMX kernels, the OS grants the permission, and the first quantized matmul dies with
    SIGILL. The probe is compiled and run, so the answer is this machine's, not a table's."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if "amx_int8" not in flags:
        return False
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "amx.c", Path(d) / "amx"
        src.write_text(_AMX_PROBE)
        if subprocess.run([cc, "-O1", "-mamx-tile", str(src), "-o", str(exe)], capture_output=True).returncode:
            return False                           # a compiler without AMX cannot emit it either
        rc = subprocess.run([str(exe)], capture_output=True).returncode
    if rc != 0:
        log.info("this CPU reports AMX but the AMX probe exited %d: building with %s", rc, NO_AMX)
    return rc != 0


def resolve_config(cuda: str = "auto", jobs: int = 0) -> BuildConfig:
    if cuda not in CUDA_CHOICES:
        raise ValueError(f"cuda must be one of {CUDA_CHOICES}, got {cuda!r}")
    if jobs < 0:
        raise ValueError(f"jobs must be >= 0 (0: all cores), got {jobs}")
    return BuildConfig(cuda=detect_cuda() if cuda == "auto" else cuda == "on", no_amx=amx_broken(), jobs=jobs)


def build_dir(config: BuildConfig, commit: str) -> Path:
    return llamacpp_root() / f"{LLAMA_CPP_PYTHON_VERSION}-{config.flags_hash(commit)}"


def finished_build(path: Path) -> BuildInfo | None:
    """The marker's record when the build at `path` finished and its binaries exist."""
    marker = path / MARKER
    if not marker.is_file():
        return None
    try:
        info = BuildInfo.read(marker)
    except (ValueError, TypeError) as e:
        log.warning("ignoring unreadable build marker %s: %s", marker, e)
        return None
    missing = [t for t in REQUIRED if not (path / "build" / "bin" / t).is_file()]
    return None if missing else info


def build(config: BuildConfig, progress: Callable[[str], None] = log.info) -> BuildInfo:
    """Build (or reuse) the pinned llama.cpp for `config`; returns the finished build's record."""
    src = source_dir()
    commit = vendored_commit(src)
    out = build_dir(config, commit)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # a second builder waits, then reuses
        done = finished_build(out)
        if done is not None:
            progress(f"llama.cpp {commit} ({config.backend}) already built in {out}")
            return done
        return _compile(config, src, commit, out, progress)


def _compile(config: BuildConfig, src: Path, commit: str, out: Path,
             progress: Callable[[str], None]) -> BuildInfo:
    bdir = out / "build"
    ninja = shutil.which("ninja")
    if not ninja and bdir.exists():
        shutil.rmtree(bdir)                        # make cannot be trusted to resume a killed build
    flags = config.cmake_flags(commit)
    jobs = config.jobs or os.cpu_count() or 1
    configure = ["cmake", "-S", str(src), "-B", str(bdir), *(["-G", "Ninja"] if ninja else []), *flags]
    compile_ = ["cmake", "--build", str(bdir), "--parallel", str(jobs), "--target", *TARGETS]
    logfile = out / "build.log"
    t0 = time.monotonic()
    with open(logfile, "w") as logf:
        for step, cmd in (("configure", configure), ("compile", compile_)):
            progress(f"llama.cpp {step}: {' '.join(cmd)}")
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            _run_logged(cmd, logf, progress, step)
    elapsed = time.monotonic() - t0
    info = BuildInfo(llama_cpp_python=LLAMA_CPP_PYTHON_VERSION, llama_cpp_commit=commit, backend=config.backend,
                     cmake_flags=flags, targets=list(TARGETS), build_dir=str(bdir), elapsed_s=round(elapsed, 1),
                     jobs=jobs, built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), compiler=_compiler())
    missing = [t for t in REQUIRED if not (bdir / "bin" / t).is_file()]
    if missing:
        raise LlamaCppBuildError(f"build finished but {missing} are not in {bdir / 'bin'}; see {logfile}")
    tmp = out / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(asdict(info), indent=2) + "\n")
    os.replace(tmp, out / MARKER)                  # the marker last: only now is the build trusted
    progress(f"llama.cpp {commit} ({config.backend}) built in {elapsed:.0f} s -> {bdir / 'bin'}")
    return info


_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def _run_logged(cmd: Sequence[str], logf: TextIO, progress: Callable[[str], None], step: str) -> None:
    """Run cmd with its output into logf; report compile progress at most every 5 %."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = -5.0
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        logf.write(line)
        tail = (tail + [line.rstrip()])[-30:]
        m = _PROGRESS.match(line)
        if m:
            pct = 100.0 * int(m[1]) / int(m[2]) if m[1] else float(m[3])
            if pct >= last + 5 or pct >= 100:
                last = pct
                progress(f"llama.cpp {step}: {pct:3.0f}% {line.strip()[:100]}")
    rc = proc.wait()
    logf.flush()
    if rc != 0:
        raise LlamaCppBuildError(f"llama.cpp {step} failed (exit {rc}); full log: {logf.name}\n" + "\n".join(tail))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or "c++"
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else "unknown"


# ---------------------------------------------------------------- find


RUN_HINT = ("the binary itself does not run here: rebuild it (`moebench setup llamacpp`) or point LLAMA_CPP_BIN "
            "at a directory of working llama-server and llama-bench")
BUILD_HINT = ("build them with `make llamacpp` (or `python -m harness.llamacpp.build`, "
              "`moebench setup llamacpp`), or point LLAMA_CPP_BIN at a directory holding "
              "llama-server and llama-bench")


def find_binaries() -> Binaries:
    """llama-server and llama-bench: from `$LLAMA_CPP_BIN` (a directory) when set, else the
    newest finished cache build (CUDA builds first on a CUDA machine), else PATH."""
    env = os.environ.get("LLAMA_CPP_BIN")
    if env:
        d = Path(env).expanduser()
        missing = [t for t in REQUIRED if not (d / t).is_file()]
        if missing:
            raise LlamaCppBuildError(f"LLAMA_CPP_BIN={env} lacks {missing}; {BUILD_HINT}")
        return Binaries(d / "llama-server", d / "llama-bench", _opt(d / "llama-quantize"), None, "LLAMA_CPP_BIN")
    builds = cached_builds()
    if builds:
        info = builds[0]
        want = resolve_config("auto")
        if info.cmake_flags != want.cmake_flags(info.llama_cpp_commit):
            log.warning("using the llama.cpp build in %s, made with other flags than this machine's "
                        "(%s); `make llamacpp` builds the matching one", info.build_dir, want)
        b = Path(info.build_dir) / "bin"
        return Binaries(b / "llama-server", b / "llama-bench", _opt(b / "llama-quantize"), info, "cache")
    found = {t: shutil.which(t) for t in REQUIRED}
    if all(found.values()):
        q = shutil.which("llama-quantize")
        return Binaries(Path(found["llama-server"]), Path(found["llama-bench"]), Path(q) if q else None, None, "PATH")
    raise LlamaCppBuildError(f"llama.cpp binaries not found: no finished build under {llamacpp_root()}, "
                             f"LLAMA_CPP_BIN unset, and {[t for t, p in found.items() if not p]} not on PATH; "
                             f"{BUILD_HINT}")


def cached_builds() -> list[BuildInfo]:
    """Finished builds of the pinned version in the cache, best first: the one `make llamacpp`
    would build on this machine, then the same backend, then newest."""
    root = llamacpp_root()
    if not root.is_dir():
        return []
    infos = [i for d in root.glob(f"{LLAMA_CPP_PYTHON_VERSION}-*") if (i := finished_build(d))]
    want = resolve_config("auto")
    return sorted(infos, key=lambda i: (i.cmake_flags != want.cmake_flags(i.llama_cpp_commit),
                                        i.backend != want.backend, -_ts(i)))


def _ts(info: BuildInfo) -> float:
    try:
        return (Path(info.build_dir).parent / MARKER).stat().st_mtime
    except OSError:
        return 0.0


def _opt(p: Path) -> Path | None:
    return p if p.is_file() else None


@lru_cache(maxsize=None)
def server_backend(server: Path) -> str:
    """Where this llama-server runs a model, as it says itself (`--list-devices`): the kind of the
    first device listed, lower-case without its index ("CUDA0" -> "cuda"), "cpu" when it lists
    none (a CPU build, or a CUDA build on a machine without a GPU), "unknown" when it cannot say.
    One rule for every origin: a cache build's record says what it was built for, not what runs."""
    try:
        proc = subprocess.run([str(server), "--list-devices"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not ask %s for its devices: %s", server, e)
        return "unknown"
    _, header, listed = (proc.stdout + proc.stderr).partition("Available devices:")
    lines = [ln.strip() for ln in listed.splitlines() if ln.startswith((" ", "\t")) and ln.strip()]
    if not header or not lines:
        return "unknown"
    first = lines[0].split(":")[0].strip()
    return "cpu" if first == "(none)" else re.sub(r"\d+$", "", first).lower()


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m harness.llamacpp.build` / `moebench setup llamacpp`: build once, print where."""
    ap = argparse.ArgumentParser(prog="moebench setup llamacpp", description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", choices=CUDA_CHOICES, default="auto",
                    help="auto: CUDA when nvcc and an NVIDIA GPU are present (default)")
    ap.add_argument("--jobs", type=int, default=0, help="parallel compile jobs (default: all cores)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        info = build(resolve_config(args.cuda, args.jobs), progress=lambda s: print(s, flush=True))
    except (LlamaCppBuildError, ValueError, OSError) as e:
        print(f"moebench setup llamacpp: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(info), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
