"""Machine measurements shared by training reports and benchmarks."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def set_threads(threads: int) -> int:
    """Pin torch's intra-op threads (0 leaves torch's default); returns the count in force."""
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


@contextmanager
def pinned_threads(threads: int) -> Iterator[int]:
    """Run a block at exactly `threads` torch intra-op threads (whatever OMP_NUM_THREADS, MKL_NUM_THREADS or
    an earlier set_num_threads said), then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def build_info() -> dict[str, str | int]:
    """What besides the settings decides a CPU computation's bits: torch build, its kernels' CPU capability
    (the instruction set it dispatched to), Python, and the threads in force."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


def matmul_flops_per_s(n: int = 1024, seconds: float = 0.5, dtype: torch.dtype = torch.float32) -> float:
    """Sustained FLOP/s of an n x n matmul with the current thread setting: the 'FLOP floor' rate."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / elapsed


def peak_rss_bytes() -> int:
    """Peak resident memory of this process since it started or since `reset_peak_rss` (Linux: VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Start the peak-RSS count again from the current RSS (Linux >= 4.0: /proc/self/clear_refs), so a
    run in a worker process that ran others before (joblib reuses its workers) reports its own peak, not
    the largest of the process's earlier runs. False where it cannot (the peak then counts from the
    process's start)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def save_report(report: dict, table: str, out: str | None, default_name: str):
    """Write a benchmark's JSON report (to `out`, or outputs/bench/<default_name>) and print its table."""
    from evictlab.store import outputs_dir, write_json

    path = Path(out) if out else outputs_dir() / "bench" / default_name
    write_json(path, report)
    print(table)
    print(f"\nwrote {path}", file=sys.stderr)
    return path
