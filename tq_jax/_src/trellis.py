"""Trellis-coded quantization (TCQ) of the rotated coordinates: TQ01 v2's ``TRELLIS`` mode.

A scalar quantizer codes each coordinate alone. TCQ (Marcellin & Fischer) codes the
``d`` coordinates of a vector as one path through a trellis, at the same fixed rate:

* the *doubled codebook* is the Lloyd–Max codebook of ``bits + 1`` bits
  (:func:`tq_jax._src.codebook.lloyd_max`), narrowed by the factor :data:`SCALES` gives
  for ``bits`` (a trellis reaches levels a scalar quantizer cannot use, so its best
  codebook is narrower), and split into four subsets ``D_j`` by index mod 4:
  ``levels[j, k] = scale · c[4k + j]``;
* the trellis has :data:`STATES` = 8 states; the state before coordinate ``t`` is the
  last three *branch bits*, ``s_t = b_{t-1} + 2 b_{t-2} + 4 b_{t-3}`` (0 before the
  start). From state ``s`` the branch ``b`` uses subset :func:`subset` ``(s, b)``;
* every coordinate stores a ``bits``-bit code ``c_t = 2 k_t + b_t``: its branch bit and
  the index ``k_t`` of its level in that subset. The bytes are the scalar codes' bytes.

The encoder (:func:`quantize`) finds the path of least squared error with a Viterbi
search per vector (8 states × ``d`` steps). The decoder needs no search and no
sequence: coordinate ``t``'s state follows from the branch bits of ``t-1..t-3``, so
every coordinate decodes at once with one lookup in a ``(8 · 2**bits,)`` table
(:func:`decode_table`, :func:`lookup`). Layer 3½, beside ``_kernels`` (which calls it):
numpy tables built from the codebook, and the two jnp kernels. The wire format's own
copy of :data:`BITS` is ``wire.TRELLIS_BITS`` (the parser imports no JAX).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import _lru
from tq_jax._src import codebook as _codebook

__all__ = ["BITS", "STATES", "SCALES", "subset", "levels", "decode_table", "quantize", "lookup", "CACHE"]

STATES = 8
# The narrowing of the doubled codebook per bit width: the factor (in steps of 0.025)
# with the least squared error on Gaussian unit vectors at head_dim 64 and 128
# (benchmarks/results/trellis_scales_cpu.md). A format constant: decoders use it as is.
SCALES = {2: 0.85, 3: 0.875, 4: 0.85, 5: 0.75, 6: 0.725, 7: 0.725}
BITS = range(2, 8)  # the doubled codebook needs bits + 1 <= 8


def subset(state, branch):
    """The subset (0..3) that ``branch`` (0/1) from ``state`` (0..7) codes into: a state's
    two branches use D0/D2 (even states) or D1/D3 (odd states), as set partitioning
    wants. Works on Python ints, numpy and jax integer arrays alike."""
    parity = ((state & 1) ^ ((state >> 2) & 1)) & 1
    return (state & 1) + 2 * (branch ^ parity)


_CACHE_KEYS = 64
CACHE = _lru.LRU("trellis tables", max_entries=_CACHE_KEYS, max_bytes=4 << 20)  # keyed by a header's (dim, bits)


def _check(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(
            f"trellis coding takes {BITS.start}..{BITS.stop - 1} bits per coordinate, got {bits!r}: its "
            f"doubled codebook has bits + 1 bits, and codebooks stop at 8."
        )


@CACHE.memoize
def levels(dim: int, bits: int) -> np.ndarray:
    """``float32 [4, 2**(bits-1)]``: ``levels[j, k]`` is level ``k`` of subset ``D_j``
    (sorted ascending in ``k``), for unit vectors of length ``dim``."""
    _check(bits)
    base = np.asarray(_codebook.lloyd_max(dim, bits + 1).centroids, np.float32)
    out = np.ascontiguousarray((base * np.float32(SCALES[bits])).reshape(-1, 4).T)
    out.flags.writeable = False
    return out


@CACHE.memoize
def decode_table(dim: int, bits: int) -> np.ndarray:
    """``float32 [8 · 2**bits]``: entry ``s · 2**bits + c`` is the level of code ``c`` read
    in state ``s`` — ``levels[subset(s, c & 1), c >> 1]``."""
    lv = levels(dim, bits)
    s, c = np.meshgrid(np.arange(STATES), np.arange(1 << bits), indexing="ij")
    out = np.ascontiguousarray(lv[subset(s, c & 1), c >> 1].reshape(-1))
    out.flags.writeable = False
    return out


# The trellis's shape, as constants of every program: the two states that lead into
# state s (``_PRED[s, k] = (s >> 1) | (k << 2)``), and the subset of that step.
_NEXT = np.arange(STATES)
_PRED = np.stack([(_NEXT >> 1) | (k << 2) for k in (0, 1)], axis=1)
_PRED_SUBSET = subset(_PRED, (_NEXT & 1)[:, None])


def _nearest(v, lv):
    """Per subset ``j``, the index and squared error of ``D_j``'s level nearest ``v``: two
    lists of four arrays of ``v``'s shape. A fixed chain of compares and selects over the
    sorted levels per subset (no gather, no float sum: the same bits on every CPU)."""
    ks, errs = [], []
    for levels_j in lv:
        k = jnp.zeros(v.shape, jnp.int32)
        val = jnp.full(v.shape, levels_j[0], jnp.float32)
        for m in range(1, levels_j.shape[0]):
            above = v > (levels_j[m - 1] + levels_j[m]) * np.float32(0.5)
            val = jnp.where(above, levels_j[m], val)
            k = k + above.astype(jnp.int32)
        ks.append(k.astype(jnp.uint8))
        errs.append(jnp.square(v - val))
    return ks, errs


def quantize(y, bits: int):
    """The Viterbi search: ``y (..., d)`` float32 -> uint8 codes ``(..., d)`` whose
    :func:`lookup` has the least squared error to ``y`` among all paths from state 0.

    The levels (:func:`levels` of ``(d, bits)``) are constants of the program. First the
    nearest level of each subset, for every coordinate at once (:func:`_nearest`); then
    the search runs over the ``d`` coordinates with every vector side by side, one cost
    per state (adds, compares and selects on whole columns, no gather), keeping one byte
    of decisions per (vector, coordinate); the traceback runs back over them. Ties go to
    the branch from the lower predecessor, so the codes are a function of ``y`` alone.
    Traceable.
    """
    shape = y.shape
    d = shape[-1]
    yt = jnp.asarray(y, jnp.float32).reshape(-1, d).T  # [d, N]: the scans run over coordinates
    n = yt.shape[1]
    ks, errs = _nearest(yt, levels(d, bits))  # four [d, N] each, kept apart (no stacked copy)

    def step(cost, err):  # cost: 8 arrays [N]; err: 4 arrays [N]
        new, decided = [], jnp.zeros(err[0].shape, jnp.uint8)
        for s in range(STATES):
            a = cost[_PRED[s, 0]] + err[_PRED_SUBSET[s, 0]]
            b = cost[_PRED[s, 1]] + err[_PRED_SUBSET[s, 1]]
            second = b < a
            new.append(jnp.where(second, b, a))
            decided = decided | (second.astype(jnp.uint8) << np.uint8(s))
        return tuple(new), decided

    inf = jnp.full((n,), jnp.inf, jnp.float32)
    cost0 = (jnp.zeros((n,), jnp.float32),) + (inf,) * (STATES - 1)
    # decisions [d, N]: bit s = the branch into state s came from its second predecessor
    cost, decisions = jax.lax.scan(step, cost0, tuple(errs))
    end = jnp.argmin(jnp.stack(cost), axis=0).astype(jnp.int32)

    def trace(state, x):
        decided, k0, k1, k2, k3 = x
        pick = (decided.astype(jnp.int32) >> state) & 1
        prev = (state >> 1) | (pick << 2)
        branch = state & 1
        sub = subset(prev, branch)
        index = jnp.where(sub == 0, k0, jnp.where(sub == 1, k1, jnp.where(sub == 2, k2, k3))).astype(jnp.int32)
        return prev, ((index << 1) | branch).astype(jnp.uint8)

    _, codes = jax.lax.scan(trace, end, (decisions, *ks), reverse=True)  # [d, N]
    return codes.T.reshape(shape)


def lookup(codes, bits: int):
    """Decode: ``codes (..., d)`` (integers < ``2**bits``) -> float32 levels ``(..., d)``,
    every coordinate at once, from :func:`decode_table` of ``(d, bits)`` (a constant of
    the program). Traceable."""
    c = jnp.asarray(codes).astype(jnp.int32)
    b = c & 1
    pad = [(0, 0)] * (c.ndim - 1)
    d = c.shape[-1]
    state = sum(jnp.pad(b, pad + [(k, 0)])[..., :d] << (k - 1) for k in (1, 2, 3))
    return jnp.take(jnp.asarray(decode_table(d, bits)), (state << bits) | c, mode="clip")
