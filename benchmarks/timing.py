"""Timing helpers shared by the benchmark scripts (no tq_jax import: any tree can use it)."""

from __future__ import annotations

import time


def best_of(fn, reps: int = 3) -> float:
    """Milliseconds of the fastest of ``reps`` calls of ``fn`` after one warm-up call,
    each waited for with ``jax.block_until_ready``."""
    import jax

    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3
