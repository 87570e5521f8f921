"""What do trellis-coded indices cost in time: turbo-4t beside turbo-4 on one LMCache chunk?

Answer (benchmarks/results/trellis_speed_cpu.md, docs/codec.md): the same bytes; the
encode (a Viterbi search of 8 states per coordinate) takes several times turbo-4's, the
decode (one table lookup per coordinate, its state read from the three previous branch
bits) a little more than turbo-4's.

Per shape (W1 ``[2, 32, 256, 8, 128]``, head_dim 128; SmolLM2-135M's chunk ``[2, 30, 256,
3, 64]``), bfloat16 Gaussian K/V: ``tq_jax.dumps`` and ``tq_jax.load_into`` (host to a
preallocated buffer) of each preset, and the two yardsticks — a memcpy of the chunk into a
preallocated buffer and the float32 ``(n, d) @ (d, d)`` GEMM of its n vectors — timed in
the same rounds, interleaved; the minimum over rounds of each.

    python -m benchmarks.studies.trellis_speed --out benchmarks/results/trellis_speed_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import tq_jax
from benchmarks.studies import report

SHAPES = {"W1 (head_dim 128)": (2, 32, 256, 8, 128), "SmolLM2-135M (head_dim 64)": (2, 30, 256, 3, 64)}
PRESETS = ("turbo-4", "turbo-4t")


def measure(shape, rounds: int) -> dict:
    """Minimum seconds over ``rounds`` interleaved rounds of each operation on ``shape``."""
    x = np.asarray(jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32), jnp.bfloat16))
    d = shape[-1]
    flat = jnp.asarray(np.random.default_rng(1).standard_normal((x.size // d, d), np.float32))
    w = jnp.asarray(np.random.default_rng(2).standard_normal((d, d), np.float32))
    gemm = jax.jit(lambda a: jnp.matmul(a, w))
    dst = np.empty_like(x)
    blobs = {p: tq_jax.dumps(x, options=p) for p in PRESETS}
    ops = {"memcpy": lambda: np.copyto(dst, x), "float32 GEMM": lambda: gemm(flat).block_until_ready()}
    for p in PRESETS:
        ops[f"{p} encode"] = lambda p=p: tq_jax.dumps(x, options=p)
        ops[f"{p} decode"] = lambda p=p: tq_jax.load_into(blobs[p], dst)
    for op in ops.values():  # warm-up: compiles
        op()
    best = {name: float("inf") for name in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            t = time.perf_counter()
            op()
            best[name] = min(best[name], time.perf_counter() - t)
    best["bytes"] = {p: len(b) for p, b in blobs.items()}
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out")
    args = p.parse_args(argv)
    commit = report.commit()
    load = os.getloadavg()[0]
    lines = [
        "# turbo-4t (trellis-coded indices) beside turbo-4: encode and decode time",
        "",
        f"Command: `python -m benchmarks.studies.trellis_speed{' --out ' + args.out if args.out else ''}` at commit "
        f"{commit}; jax {jax.__version__} on {platform.machine()} ({os.cpu_count()} CPUs, load average {load:.1f} at "
        f"start: a shared machine), Python {platform.python_version()}. bfloat16 Gaussian K/V; `tq_jax.dumps`, and "
        "`tq_jax.load_into` a preallocated buffer; the minimum of "
        f"{args.rounds} interleaved rounds. Yardsticks in the same rounds: memcpy of the chunk into a preallocated "
        "buffer, and the float32 `(n, d) @ (d, d)` GEMM of its n vectors.",
        "",
        "| chunk | blob bytes (both) | memcpy ms | GEMM ms | turbo-4 encode ms (x GEMM) | turbo-4t encode ms (x GEMM) "
        "| turbo-4t / turbo-4 encode | turbo-4 decode ms | turbo-4t decode ms | turbo-4t / turbo-4 decode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, shape in SHAPES.items():
        m = measure(shape, args.rounds)
        assert m["bytes"]["turbo-4"] == m["bytes"]["turbo-4t"]
        ms = {k: v * 1e3 for k, v in m.items() if k != "bytes"}
        g = ms["float32 GEMM"]
        lines.append(
            f"| {label} `{list(shape)}` | {m['bytes']['turbo-4']:,} | {ms['memcpy']:.2f} | {g:.1f} | "
            f"{ms['turbo-4 encode']:.1f} ({ms['turbo-4 encode'] / g:.1f}) | {ms['turbo-4t encode']:.1f} "
            f"({ms['turbo-4t encode'] / g:.1f}) | {ms['turbo-4t encode'] / ms['turbo-4 encode']:.2f}x | "
            f"{ms['turbo-4 decode']:.1f} | {ms['turbo-4t decode']:.1f} | "
            f"{ms['turbo-4t decode'] / ms['turbo-4 decode']:.2f}x |")
        print(lines[-1], flush=True)
    report.write(lines, args.out)


if __name__ == "__main__":
    main()
