"""The context of a measurement on this machine: intra-op threads, cores, and how busy the other
processes keep them (DESIGN.md rule 7.9; CPU timings mean little on a busy machine).

Owns: `LoadWindow(threads)`, opened and closed around other work, giving a `MachineLoad` -- the
1-minute load average, the cores this process may use, and the cores other processes kept busy
over the window (at least `SAMPLE_S`; total CPU time minus this process's own and its
children's, so a previous job of the same sweep, or the job's own server, does not count as
"other") -- and the warning rule: a run is `busy` when other processes take more cores than this
run leaves free.
Does not own: setting threads (harness.runner) or rows.

    window = LoadWindow(threads=torch.get_num_threads())     # ... the job's own work ...
    load = window.close()
    if load.busy: reporter.warn(load.warning())
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from harness.config.schema import RunSpec

SAMPLE_S = 0.1


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def physical_cores_available() -> int:
    """Physical cores among the CPUs this process may run on (SMT siblings counted once):
    torch's intra-op threads beyond that only contend for the same cores."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return psutil.cpu_count(logical=False) or available_cores()
    cores = set()
    for cpu in cpus:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/core_id") as a, open(f"{topo}/physical_package_id") as b:
                cores.add((a.read().strip(), b.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def default_threads() -> int:
    """The intra-op thread count of a run that does not set run.threads: OMP_NUM_THREADS when the
    environment sets it (a user's or CI's explicit choice), else the physical cores available."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return physical_cores_available()


def job_threads(spec: RunSpec) -> int:
    """The intra-op threads a job runs with: run.threads, else `default_threads()`."""
    return spec.run.threads or default_threads()


@dataclass(frozen=True)
class MachineLoad:
    load_avg_1m: float | None
    cores: int
    threads: int
    other_busy_cores: float | None

    @property
    def free_cores(self) -> int:
        return max(self.cores - self.threads, 0)

    @property
    def busy(self) -> bool:
        """Other processes took more cores than this run leaves free: its timings are suspect."""
        return self.other_busy_cores is not None and self.other_busy_cores > self.free_cores + 0.5

    def warning(self) -> str:
        return (f"warning: other processes keep {self.other_busy_cores:.1f} of {self.cores} cores busy "
                f"(load average {self.load_avg_1m}) while this run uses {self.threads} thread(s); its timings "
                "will be slower and noisier than on a quiet machine (see docs/measurement.md: Threads and the CPU)")

    def as_dict(self) -> dict:
        return asdict(self)


class LoadWindow:
    """Other processes' CPU use from opening to `close()`: the machine's busy CPU time less this
    process's own and its children's (`_own_cpu`), so the window may span the job's own work (it
    samples while the job builds its workload, and over its measurement, instead of waiting).
    `close` sleeps what is left of `window_s`."""

    def __init__(self, threads: int, window_s: float = SAMPLE_S) -> None:
        self.threads, self.window_s, self._me = threads, window_s, psutil.Process()
        try:
            self.load1: float | None = os.getloadavg()[0]
        except OSError:
            self.load1 = None
        self._t0, self._own0, self._busy0 = time.perf_counter(), _own_cpu(self._me), _busy_cpu()

    def close(self) -> MachineLoad:
        time.sleep(max(0.0, self._t0 + self.window_s - time.perf_counter()))
        t1, own1, busy1 = time.perf_counter(), _own_cpu(self._me), _busy_cpu()
        other = max(0.0, ((busy1 - self._busy0) - (own1 - self._own0)) / (t1 - self._t0))
        return MachineLoad(self.load1, available_cores(), self.threads, round(other, 3))


def _own_cpu(p: psutil.Process) -> float:
    """CPU seconds of this process and of its children, finished (reaped) and running: a server
    the job started (llama-server) works for the job, not against it."""
    total = _cpu_s(p.cpu_times())
    for child in p.children(recursive=True):
        try:
            total += _cpu_s(child.cpu_times())
        except psutil.Error:               # gone between the listing and the reading
            pass
    return total


def _cpu_s(t) -> float:
    return t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)


def _busy_cpu() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
