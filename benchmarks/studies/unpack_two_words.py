"""How fast does the Hadamard decode kernel unpack indices whose group of 8 spans two
uint32 words (5 and 7 bits)? Answer: per-lane scalar shifts run about twice as fast as
one vector of per-lane shifts over both words when norm correction is on; and log-coded
norms decode about 5x faster from per-group level tables than with an exp per vector,
with the same bits. Written in benchmarks/results/design_notes.md.

    python -m benchmarks.studies.unpack_two_words [--vectors 7680] [--dim 64]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import _kernels, codec, norms, packing


def vector_shift_unpack(packed, bits: int, n: int):
    """The earlier ``unpack_groups``: every lane shifted out of every word by a vector of
    per-lane amounts (a shift of 32 or more gives 0)."""
    g = packing.plane_count(bits)
    per = g * bits // 8
    v = packed.reshape(*packed.shape[:-1], n // g, per).astype(jnp.uint32)
    starts, out = np.arange(g) * bits, None
    for k in range(-(-per // 4)):
        word = v[..., 4 * k]
        for j in range(4 * k + 1, min(4 * k + 4, per)):
            word = word | (v[..., j] << jnp.uint32(8 * (j - 4 * k)))
        rel = starts - 32 * k
        right = np.where((rel >= 0) & (rel < 32), rel, 32).astype(np.uint32)
        left = np.where((rel < 0) & (rel > -32), -rel, 32).astype(np.uint32)
        piece = word[..., None] >> jnp.asarray(right)
        if (left < 32).any():
            piece = piece | (word[..., None] << jnp.asarray(left))
        out = piece if out is None else out | piece
    return out & jnp.uint32((1 << bits) - 1)


def best_ms(fn, *args, reps: int = 150) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def per_vector_log_norms(ranges, codes, bits, n):
    """The earlier ``decode_log_norms``: unpackbits, a sum per code, an exp per vector."""
    ranges = np.asarray(ranges, np.float32).reshape(-1, 2)
    planes = np.unpackbits(codes, count=n * bits, bitorder="little").reshape(n, bits)
    c = (planes.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(1, dtype=np.uint16)
    c = c.reshape(ranges.shape[0], -1).astype(np.float32)
    lo, hi = ranges[:, :1], ranges[:, 1:]
    step = (hi - lo) / np.float32(2**bits - 2)
    with np.errstate(over="ignore", under="ignore"):
        out = np.exp(lo + (c - 1) * step)
    return np.where(c > 0, out, np.float32(0)).astype(np.float32).reshape(-1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vectors", type=int, default=7680)
    p.add_argument("--dim", type=int, default=64)
    a = p.parse_args(argv)
    print(f"jax {jax.__version__}, {a.vectors} vectors of d={a.dim}, bfloat16 out, best of 150 (ms)\n")
    print("| bits | norm correction | decode, unpack_groups | decode, vector shifts | unpack_groups alone | vector shifts alone |")
    print("|---:|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    original = _kernels._packing.unpack_groups
    for bits in range(1, 9):
        packed = jnp.asarray(rng.integers(0, 256, (a.vectors, a.dim * bits // 8), dtype=np.uint8))
        scale = jnp.asarray(rng.random(a.vectors, dtype=np.float32))
        tabs = codec.tables(codec.CodecConfig(dim=a.dim, bits=bits, seed=0, rotation="hadamard"))
        old = jax.jit(vector_shift_unpack, static_argnames=("bits", "n"))
        assert (np.asarray(old(packed, bits, a.dim)) == np.asarray(original(packed, bits, a.dim))).all()
        alone = [best_ms(jax.jit(lambda q, f=f: f(q, bits, a.dim)), packed) for f in (original, old)]
        for nc in (False, True):
            row = []
            for unpack in (original, old):
                _kernels._packing.unpack_groups = unpack
                try:
                    fn = jax.jit(lambda q, s: _kernels.decode_groups(q, s, tabs, bits, jnp.bfloat16, nc))
                    row.append(best_ms(fn, packed, scale))
                finally:
                    _kernels._packing.unpack_groups = original
            print(f"| {bits} | {'yes' if nc else 'no'} | {row[0]:.2f} | {row[1]:.2f} | {alone[0]:.2f} | {alone[1]:.2f} |")
    x = np.exp(rng.normal(0, 3, 23040)).astype(np.float32)
    ranges, codes = norms.encode_log_norms(x, 30, 6)
    new = norms.decode_log_norms(ranges, codes, 6, x.size)
    assert (new.view(np.uint32) == per_vector_log_norms(ranges, codes, 6, x.size).view(np.uint32)).all()
    t = [best_ms(lambda f=f: f(ranges, codes, 6, x.size)) for f in (norms.decode_log_norms, per_vector_log_norms)]
    print(f"\n23,040 log-coded norms at 6 bits (30 groups): level tables {t[0]:.3f} ms, exp per vector {t[1]:.3f} ms "
          "(bit-identical)")


if __name__ == "__main__":
    main()
