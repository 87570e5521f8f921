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
