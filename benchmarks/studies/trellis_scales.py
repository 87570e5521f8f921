"""How far should the trellis narrow its doubled codebook, per bit width?

Answer (benchmarks/results/trellis_scales_cpu.md, docs/TQ01-v2.md): the squared error of
the trellis codes of Gaussian unit vectors is least at a narrowing between 0.70 and
0.875 of the doubled Lloyd–Max codebook, within one step of 0.025 between head_dim 64
and 128; ``tq_jax._src.trellis.SCALES`` holds the chosen factor per width, a format
constant. Against the scalar Lloyd–Max codebook of the same bits (its expected error, in
closed form) the trellis gains 1.3–1.7 dB at 2–5 bits, more at 6–7 bits, where the
reference's scalar tables are not fully converged.

For each head_dim and width, 4,096 Gaussian unit vectors (seed 0) are searched by the
Viterbi encoder of ``tq_jax._src.trellis`` over the doubled codebook scaled by each
factor of the sweep, and decoded by the same levels.

    python -m benchmarks.studies.trellis_scales --out benchmarks/results/trellis_scales_cpu.md
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.studies import report
from tq_jax._src import codebook, trellis

SWEEP = np.round(np.arange(0.60, 1.0001, 0.025), 3)


def error(y: np.ndarray, bits: int, scale: float) -> float:
    """Mean squared error per vector of the trellis codes of ``y`` when the doubled
    codebook is narrowed by ``scale`` (the format's search and decode otherwise)."""
    d = y.shape[-1]
    base = np.asarray(codebook.lloyd_max(d, bits + 1).centroids, np.float32)
    lv = (base * np.float32(scale)).reshape(-1, 4).T
    c = np.asarray(_search(jnp.asarray(y), lv)).astype(np.int64)
    b = c & 1
    state = np.zeros_like(c)
    for k in (1, 2, 3):  # the state: the three previous branch bits (docs/TQ01-v2.md)
        state[:, k:] |= b[:, :-k] << (k - 1)
    return float(np.mean(np.sum((lv[trellis.subset(state, b), c >> 1] - y) ** 2, axis=-1)))


def _search(y, lv):
    """:func:`tq_jax._src.trellis.quantize` with the levels ``lv`` in place of the format's."""
    bits = int(np.log2(lv.shape[1])) + 1
    saved = trellis.levels
    trellis.levels = lambda dim, b: lv  # the search reads the levels through this name
    try:
        return jax.jit(lambda v: trellis.quantize(v, bits))(y)
    finally:
        trellis.levels = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vectors", type=int, default=4096)
    p.add_argument("--out")
    args = p.parse_args(argv)
    commit = report.commit()
    lines = [
        "# The trellis's narrowing of its doubled codebook, per bit width",
        "",
        f"Command: `python -m benchmarks.studies.trellis_scales{' --out ' + args.out if args.out else ''}` at commit "
        f"{commit}. {args.vectors} Gaussian unit vectors (seed 0) per head_dim; mean squared error per vector of "
        "the trellis codes with the doubled Lloyd–Max codebook narrowed by each factor of a sweep "
        f"({SWEEP[0]}..{SWEEP[-1]} in steps of 0.025); the scalar codebook's error is its expected value "
        "(`codebook.expected_mse` × head_dim).",
        "",
        "| head_dim | bits | best factor | error at it | at the format's factor | scalar Lloyd–Max | gain (dB) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in (64, 128):
        y = np.random.default_rng(0).standard_normal((args.vectors, d))
        y = (y / np.linalg.norm(y, axis=-1, keepdims=True)).astype(np.float32)
        for bits in trellis.BITS:
            errs = {float(s): error(y, bits, float(s)) for s in SWEEP}
            best = min(errs, key=errs.get)
            chosen = errs[min(errs, key=lambda s: abs(s - trellis.SCALES[bits]))]
            scalar = codebook.expected_mse(d, bits) * d
            lines.append(f"| {d} | {bits} | {best:.3f} | {errs[best]:.3e} | {trellis.SCALES[bits]} → {chosen:.3e} | "
                         f"{scalar:.3e} | {10 * np.log10(scalar / chosen):.2f} |")
            print(lines[-1], flush=True)
    report.write(lines, args.out)


if __name__ == "__main__":
    main()
