"""Timing helpers shared by the benchmark scripts (no tq_jax import: any tree can use it)."""

from __future__ import annotations

import time


def best_wall_and_cpu(fn, reps: int = 3) -> tuple[float, float]:
    """``(wall ms, CPU ms)``: the fastest of ``reps`` calls of ``fn`` after one warm-up
    call, each waited for with ``jax.block_until_ready``, by the wall clock and by this
    process's CPU time (all threads). CPU time moves less than wall time when other jobs
    share the machine."""
    import jax

    jax.block_until_ready(fn())
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall) * 1e3, min(cpu) * 1e3


def best_of(fn, reps: int = 3) -> float:
    """Wall milliseconds of the fastest of ``reps`` calls (:func:`best_wall_and_cpu`)."""
    return best_wall_and_cpu(fn, reps)[0]


class Yardsticks:
    """The CPU yardsticks results are stated against, sized to ``raw`` (the raw bytes of
    the workload): a memcpy of ``raw`` into a preallocated buffer, and the float32
    ``(n,128)@(128,128)`` GEMM over as many coordinates, which every exact v1 coder runs.
    :meth:`time_round` times one of each (call it between the workload's own rounds, so
    both see the same machine); :meth:`medians` gives ``(memcpy s, GEMM s)``."""

    def __init__(self, raw) -> None:
        import numpy as np

        self.raw, self.dst = raw, np.empty_like(raw)
        self.a = np.random.default_rng(1).standard_normal((raw.size // 128, 128)).astype(np.float32)
        self.b = np.random.default_rng(2).standard_normal((128, 128)).astype(np.float32)
        self.out = np.empty_like(self.a)
        self.memcpy: list[float] = []
        self.gemm: list[float] = []

    def time_round(self) -> None:
        import numpy as np

        t = time.perf_counter()
        np.copyto(self.dst, self.raw)
        self.memcpy.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.matmul(self.a, self.b, out=self.out)
        self.gemm.append(time.perf_counter() - t)

    def medians(self) -> tuple[float, float]:
        import statistics

        return statistics.median(self.memcpy), statistics.median(self.gemm)


def cpu_description() -> str:
    """The CPU's model name and widest vector extension (``"AMD EPYC, AVX2"``): the same
    code runs at different speeds on AVX2-only and AVX-512 machines, so results say which."""
    import platform
    from pathlib import Path

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = info.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model or platform.machine()}, {widest}"
