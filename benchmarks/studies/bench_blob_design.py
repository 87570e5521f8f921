"""Study. Question: how should the host block driver hand blocks to the kernels (numpy
arguments or device_put, who stages unaligned blocks, how big a CPU block)?

Answer: numpy blocks as arguments of the jitted call (~14 us a call against ~140 us
with a device_put first), numpy staging of unaligned blocks (~36 us against 190-620 us
for XLA's copy), and 2**19 coordinates per CPU block (within 5 % of 2**20 today, kept
because the block size can move the last bit of float32 norms). Written in
benchmarks/results/design_notes.md ("Block driver"); the choices live in
tq_jax/_src/blocks.py.

The measurements behind three choices of the block driver, re-run side by side:

1. Blocks reach the kernels as numpy arguments of the jitted call, not through a
   separate ``jax.device_put`` (per-call overhead of each, one 4096 x 128 bf16 block).
2. Unaligned blocks are copied into 64-byte-aligned staging buffers by numpy rather
   than left to XLA's copy (one 1 MiB block, both ways).
3. The CPU block size: ``CPU_BLOCK_COORDS`` (2**19 coordinates) against the default
   2**20, W1 4-bit encode and decode, Haar and Hadamard.

    python -m benchmarks.studies.bench_blob_design      # from the repository root; prints a markdown table
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import tq_jax
from benchmarks.timing import best_of
from tq_jax._src import blocks

W1 = (2, 32, 256, 8, 128)


def per_call_us(fn, reps=200):
    fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts) * 1e6


def main():
    dev = jax.devices()[0]
    rows = []
    block = blocks.aligned_empty((4096, 128), jnp.bfloat16)  # 64-byte aligned: shared, not copied, on CPU
    block[...] = 0
    ident = jax.jit(lambda x: x[0, 0])
    rows.append(("jitted call, numpy block as argument", per_call_us(lambda: ident(block).block_until_ready()), "µs"))
    rows.append(("jax.device_put of the block, then the call",
                 per_call_us(lambda: ident(jax.device_put(block, dev)).block_until_ready()), "µs"))

    raw = np.zeros(4096 * 128 * 2 + 64 + 1, np.uint8)
    off = 1 if raw.ctypes.data % 64 else 2  # deliberately not 64-byte aligned
    src = raw[off : off + 4096 * 128 * 2].view(jnp.bfloat16).reshape(4096, 128)
    dst = blocks.aligned_empty(src.shape, src.dtype)
    rows.append(("numpy copy of an unaligned 1 MiB block into an aligned buffer",
                 per_call_us(lambda: np.copyto(dst, src), 50), "µs"))
    rows.append(("XLA's copy of the same unaligned block (jnp.asarray)",
                 per_call_us(lambda: jnp.asarray(src).block_until_ready(), 50), "µs"))

    x = np.random.default_rng(0).standard_normal(W1, np.float32).astype(jnp.bfloat16)
    timed = {}
    for rot in ("haar", "hadamard"):
        opts = tq_jax.encode_options(bits=4, rotation=rot)
        b = tq_jax.dumps(x, options=opts)
        for coords in (1 << 19, 1 << 20):
            bv = coords // W1[-1]
            timed[f"W1 4-bit {rot} encode, {coords} coordinates per block"] = (
                lambda opts=opts, bv=bv: tq_jax.dumps(x, options=opts, block_vectors=bv))
            timed[f"W1 4-bit {rot} decode, {coords} coordinates per block"] = (
                lambda b=b, bv=bv: tq_jax.loads(b, block_vectors=bv))
    rounds = {k: [] for k in timed}
    for _ in range(5):  # interleaved rounds, median of each case's best-of-5
        for k, fn in timed.items():
            rounds[k].append(best_of(fn, reps=5))
    rows += [(k, statistics.median(v), "ms") for k, v in rounds.items()]
    print(f"jax {jax.__version__}, {dev.platform}\n")
    print("| case | time |\n|---|---|")
    for name, v, unit in rows:
        print(f"| {name} | {v:.1f} {unit} |")


if __name__ == "__main__":
    main()
