"""Decode attention on the compressed cache vs dense attention over an uncompressed one.

Batch 4, 8 KV heads, GQA 4 (32 query heads), head_dim 128, one query per sequence
(decode), every sequence holding T tokens, T in 1k...32k. Timed, in one process,
interleaved in each round after warm-up (compiles excluded), median over rounds:

* ``kvcache.attend`` (``impl="xla"``) on a 4/4-bit Haar cache (codes + float16 norms)
  with the default exact window (the last 128 tokens also in bf16), and with ``window=0``;
* dense attention in XLA over a bfloat16 K/V cache laid out ``[B, H, T, D]``: one jitted
  ``einsum`` softmax ``einsum`` with GQA, bf16 operands and float32 accumulation
  (``preferred_element_type``). Of the plain forms measured (this one; bf16 einsums with
  bf16 results; an explicit upcast to float32 first) it was the fastest on this CPU, so
  it is the baseline;
* the same dense attention over a float32 K/V cache.

Also reported: the cache's bytes against the bf16 cache's, the compiled programs' peak
scratch memory (XLA's ``memory_analysis().temp_size_in_bytes``: what a call allocates
besides its arguments and output), and the cosine between ``attend`` and dense float32
attention over the original (unquantized) K/V.

    python benchmarks/bench_kvcache.py            # writes benchmarks/results/kvcache.md
    python benchmarks/bench_kvcache.py --quick    # 1k/2k only, 3 rounds, no file
    python benchmarks/bench_kvcache.py --sizes 8192 --rounds 15 --out /tmp/k.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax import kvcache

B, H, G, D = 4, 8, 4, 128


def dense_attention(q, k, v):
    """Decode attention over a dense cache: q [B, 1, H*G, D], k/v [B, H, T, D] (head-major,
    the layout that needs no transpose per call)."""
    qg = q.reshape(B, H, G, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32) / np.float32(np.sqrt(D))
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgt,bhtd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, 1, H * G, D).astype(q.dtype)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def bench(tokens: int, rounds: int, rng) -> dict:
    k = rng.standard_normal((B, tokens, H, D), dtype=np.float32)
    v = rng.standard_normal((B, tokens, H, D), dtype=np.float32)
    q = rng.standard_normal((B, 1, H * G, D), dtype=np.float32)
    append = jax.jit(kvcache.append, donate_argnums=0)
    chunk = 1024
    caches = {}
    for window in (kvcache.DEFAULT_WINDOW, 0):
        cache = kvcache.init(B, tokens, H, D, key_bits=4, value_bits=4, rotation="haar", seed=42, window=window)
        for s in range(0, tokens, chunk):  # prefill in chunks: one compiled program
            kc, vc = (jnp.asarray(a[:, s : s + chunk], jnp.bfloat16) for a in (k, v))
            cache = append(cache, kc, vc)
        caches[window] = cache
    cache, codes_only = caches[kvcache.DEFAULT_WINDOW], caches[0]
    kh, vh = (np.ascontiguousarray(a.transpose(0, 2, 1, 3)) for a in (k, v))  # [B, H, T, D]
    kb, vb, qb = (jnp.asarray(a, jnp.bfloat16) for a in (kh, vh, q))
    kf, vf, qf = (jnp.asarray(a) for a in (kh, vh, q))
    attend = jax.jit(kvcache.attend)
    dense = jax.jit(dense_attention)
    temp = {
        "attend": attend.lower(cache, qb).compile().memory_analysis().temp_size_in_bytes,
        "dense bf16": dense.lower(qb, kb, vb).compile().memory_analysis().temp_size_in_bytes,
    }
    runs = {
        "attend (4/4-bit codes)": (attend, cache, qb),
        "attend, window 0": (attend, codes_only, qb),
        "dense bf16": (dense, qb, kb, vb),
        "dense f32": (dense, qf, kf, vf),
    }
    for fn, *args in runs.values():  # warm-up: compile
        timed(fn, *args)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, *args) in runs.items():
            times[name].append(timed(fn, *args))
    ours = np.asarray(attend(cache, qb), np.float32).reshape(-1, D)
    ref = np.asarray(dense(qf, kf, vf)).reshape(-1, D)
    cos = float(np.mean(np.sum(ours * ref, -1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))))
    return {
        "tokens": tokens,
        "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "ratio_bf16": statistics.median(a / b for a, b in zip(times["attend (4/4-bit codes)"], times["dense bf16"])),
        "ratio_f32": statistics.median(a / b for a, b in zip(times["attend (4/4-bit codes)"], times["dense f32"])),
        "bytes": kvcache.nbytes(cache),
        "bf16_bytes": 2 * B * tokens * H * D * 2,
        "temp": temp,
        "block": cache.config.block_tokens,
        "cosine": cos,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kvcache.md"))
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    sizes = args.sizes or ((1024, 2048) if args.quick else (1024, 2048, 4096, 8192, 16384, 32768))
    rounds = args.rounds or (3 if args.quick else 9)
    load = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    rng = np.random.default_rng(0)
    rows = [bench(t, rounds, rng) for t in sizes]
    names = list(rows[0]["ms"])
    lines = [
        "# Decode attention: compressed cache vs dense",
        "",
        f"Commit {commit}; command: `python benchmarks/bench_kvcache.py{' ' + ' '.join(argv or []) if argv else ''}`.",
        "",
        f"Batch {B}, {H} KV heads, GQA {G} ({H * G} query heads), head_dim {D}, one query per sequence, "
        f"every sequence T tokens; jax {jax.__version__} on {jax.devices()[0].platform} "
        f"({len(jax.devices())} device); median ms of {rounds} interleaved rounds after warm-up "
        f"(`python benchmarks/bench_kvcache.py`). Ratios are medians of per-round ratios. "
        f"Peak scratch: the compiled program's temp bytes (besides arguments and output). "
        f"`attend (4/4-bit codes)` is the default cache: 4/4 bits and an exact window of the last "
        f"{kvcache.DEFAULT_WINDOW} tokens (bf16), read in the same online softmax; `attend, window 0` reads "
        f"every token from codes.",
        "",
        "| T | " + " | ".join(f"{n} ms" for n in names) + " | attend / dense bf16 | attend / dense f32 "
        "| cache bytes (x bf16) | peak scratch attend / dense bf16 | attend block | cosine vs dense f32 over raw K/V |",
        "|---" * (len(names) + 7) + "|",
    ]
    for r in rows:
        ms = " | ".join(f"{r['ms'][n]:.1f}" for n in names)
        lines.append(
            f"| {r['tokens']} | {ms} | {r['ratio_bf16']:.2f}x | {r['ratio_f32']:.2f}x | "
            f"{r['bytes']:,} ({r['bytes'] / r['bf16_bytes']:.3f}) | "
            f"{r['temp']['attend'] / 2**20:.1f} MiB / {r['temp']['dense bf16'] / 2**20:.1f} MiB | "
            f"{r['block']} | {r['cosine']:.4f} |"
        )
    lines += [
        "",
        f"Load average at start: {load:.1f} (2 CPUs shared with other jobs: ratios move by about "
        "+-0.1 between runs; the interleaved rounds keep the two sides of a ratio under the same load).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
