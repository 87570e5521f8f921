"""Private kernels of :mod:`tq_jax._src.codec`: quantizer search, structured rotations,
the row / group / stream encoders and decoders, and their jitted entry points.

Everything here is a pure function of arrays (and of static Python ints); the tables
(:class:`Tables`: a :class:`RotationOp`, centroids, boundaries, search grid) are
defined here and built by :mod:`tq_jax._src.codec`, which passes them in or closes over
them. Nothing here caches device arrays. The block entry points (:func:`encode_stream`, :func:`decode_stream`) pick their kernel
family by two tests, :func:`grouped` and :func:`planar`, and :func:`layout` names the
result. Library callers outside this module go through :mod:`tq_jax._src.codec`'s public
functions; the names without a leading underscore are this module's interface to
codec and to the kernel tests (tests/test_codec.py), which check each kernel alone.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src import _lru
from tq_jax._src import codebook as _codebook
from tq_jax._src import packing as _packing
from tq_jax._src import rotation as _rotation
from tq_jax._src import trellis as _trellis

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, Float32


class RotationOp(NamedTuple):
    """A rotation as arrays (a pytree): ``dense`` for Haar, ``signs``/``odd`` for Hadamard."""

    dense: "Float32[Array, 'd d'] | None" = None
    signs: "Float32[Array, ' d'] | None" = None
    odd: "Float32[Array, 'm m'] | None" = None


class Tables(NamedTuple):
    """The arrays a codec closes over (built once per config by :mod:`tq_jax._src.codec`;
    host numpy there, device arrays in its device tables)."""

    rotation: RotationOp
    centroids: np.ndarray  # float32 (2**bits,)
    boundaries: np.ndarray  # float32 (2**bits - 1,)
    grid: tuple | None  # (lo, inv_width, start int32 (M,), bound float32 (M,)) for bits > 4
    # The dense rotation with its rows in planar order (packing.plane_order), so that
    # ``rotate`` yields coordinates ready to pack; None for Hadamard (its output is
    # regrouped in the kernel) or when rows are not byte-aligned (dim*bits % 8 != 0).
    planar_dense: np.ndarray | None
    # Trellis-coded indices (TQ01 v2 TRELLIS; tq_jax._src.trellis, whose tables are
    # constants of the (dim, bits) programs): ``()`` marks them, None the scalar codebook.
    # An empty tuple is pytree structure with no leaves, so under ``jit`` the choice is
    # static, like ``grid``'s None.
    trellis: tuple | None = None

NORM_EPS = 1e-10  # the reference's guard in u = x / (n + eps)
_HADAMARD_FACTOR = 16  # the Hadamard part is applied as Kronecker factors of order <= 16

# Widths up to this many bits quantize by a branch-free binary search over the
# boundaries (``bits`` compares); wider codebooks use a uniform grid over the
# boundary range that narrows each coordinate to one candidate boundary.
_COMPARE_ALL_MAX_BITS = 4
_GRID_CELLS_PER_LEVEL = 4


def _search_grid(boundaries: np.ndarray):
    """A uniform grid over ``[b_0, b_last]`` where each cell meets at most one boundary.

    For cell ``t`` (widened by half a cell on each side, which absorbs float32
    rounding of the cell computation) ``start[t]`` counts the boundaries below it and
    ``bound[t]`` is the single boundary inside it (``+inf`` when there is none), so
    ``idx = start[t] + (y > bound[t])`` equals the exact count of boundaries below
    ``y``. The cell count doubles until that single-boundary property holds.
    """
    b = boundaries.astype(np.float64)
    lo, hi = float(b[0]), float(b[-1])
    cells = _GRID_CELLS_PER_LEVEL * (len(b) + 1)
    while True:
        width = (hi - lo) / cells
        left = lo + np.arange(cells) * width
        start = np.searchsorted(b, left - width / 2, side="left")
        end = np.searchsorted(b, left + 1.5 * width, side="right")
        if (end - start).max() <= 1:
            break
        cells *= 2
    padded = np.append(boundaries.astype(np.float32), np.float32(np.inf))
    return (
        np.float32(lo),
        np.float32(1.0 / width),
        start.astype(np.int32),
        padded[start],
    )


# Keyed by a header's (dim, bits): bounded like every table cache (tq_jax._src._lru).
QUANTIZERS = _lru.LRU("quantizer tables", max_entries=64, max_bytes=16 << 20)


@QUANTIZERS.memoize
def quantizer(dim: int, bits: int):
    """``(codebook, grid)`` of ``(dim, bits)``: the quantizer's tables, independent of
    the seed (the group encoder embeds them as constants)."""
    cb = _codebook.lloyd_max(dim, bits)
    return cb, (_search_grid(cb.boundaries) if bits > _COMPARE_ALL_MAX_BITS else None)



def planar(dim: int, bits: int) -> bool:
    """Rows are byte-aligned, so the kernels can work on index planes."""
    return dim % _packing.plane_count(bits) == 0


# --------------------------------------------------------------------------- kernels


def _pick(bits_so_far, values):
    """``values[k]`` where ``k`` is the number whose binary digits (MSB first) are the
    boolean arrays ``bits_so_far``: a tree of ``len(values) - 1`` selects."""
    if not bits_so_far:
        return values[0]
    half = len(values) // 2
    return jnp.where(bits_so_far[0], _pick(bits_so_far[1:], values[half:]), _pick(bits_so_far[1:], values[:half]))


def quantize(y, boundaries, grid):
    """Index of the nearest centroid = number of boundaries strictly below ``y``.

    Up to 4 bits: a branch-free binary search — ``bits`` comparisons, each against a
    boundary chosen by the previous answers with selects over the (sorted) table.
    Every comparison is ``y > b`` as in a full count, so the result is exactly the
    count of boundaries below ``y`` (NaN compares false everywhere: index 0). Wider
    codebooks narrow ``y`` to one boundary with a uniform grid (``_search_grid``).
    """
    if grid is None:
        n_bits = (boundaries.shape[0] + 1).bit_length() - 1
        answers = []
        for level in range(n_bits):
            step = 1 << (n_bits - level - 1)
            # the middle boundary of each interval the answers so far leave open
            cands = [boundaries[p * 2 * step + step - 1] for p in range(1 << level)]
            answers.append(y > _pick(answers, cands))
        idx = jnp.zeros(y.shape, jnp.uint8)
        for level, a in enumerate(answers):
            idx = idx | (a.astype(jnp.uint8) << jnp.uint8(n_bits - 1 - level))
        return idx
    lo, inv_width, start, bound = grid
    cells = start.shape[0]
    # Non-finite coordinates (from a non-finite vector) take cell 0; their norm
    # carries the non-finiteness through decode.
    pos = jnp.where(jnp.isfinite(y), (y - lo) * inv_width, 0.0)
    t = jnp.clip(pos, 0, cells - 1).astype(jnp.int32)
    s = jnp.take(start, t, mode="clip")
    b = jnp.take(bound, t, mode="clip")
    return (s + (y > b).astype(jnp.int32)).astype(jnp.uint8)


_HI = jax.lax.Precision.HIGHEST


def _hadamard_last(v):
    """``v @ H_p`` along the last axis, as Kronecker factors of order <= 16."""
    p = v.shape[-1]
    if p == 1:
        return v
    f = min(p, _HADAMARD_FACTOR)
    h = jnp.asarray(_rotation.hadamard(f), jnp.float32)
    if f == p:
        return jnp.matmul(v, h, precision=_HI)
    # H_p = H_f ⊗ H_(p/f): apply H_f to the leading factor axis, recurse on the rest.
    w = v.reshape(*v.shape[:-1], f, p // f)
    w = jnp.matmul(h, _hadamard_last(w), precision=_HI)
    return w.reshape(v.shape)


_OUTER_SUM_MAX = 8  # outer factors up to this order are written as sums of scaled slices (n² terms: compile time)


def _kron_apply(v, odd, transpose: bool):
    """``(odd ⊗ H_p) v`` (or its transpose) along the last axis of ``v``.

    With ``p >= 16`` this is ``(odd ⊗ H_(p/16)) ⊗ H_16``: the ``H_16`` part is one GEMM
    over contiguous groups of 16, and an outer factor of order ``n = d/16 <= 8`` is
    applied as ``n`` sums of ``n`` scaled slices, which XLA fuses into whatever reads
    the result — no transposes and no second small GEMM, so the outer factor costs no
    pass of its own over the block. Otherwise the factors are GEMMs along their axes.
    """
    d, m = v.shape[-1], odd.shape[0]
    p = d // m
    n = d // _HADAMARD_FACTOR
    if p >= _HADAMARD_FACTOR and n <= _OUTER_SUM_MAX:
        batch = v.shape[:-1]
        h = jnp.asarray(_rotation.hadamard(_HADAMARD_FACTOR), jnp.float32)
        z = jnp.matmul(v.reshape(-1, _HADAMARD_FACTOR), h, precision=_HI).reshape(*batch, n, _HADAMARD_FACTOR)
        outer = _outer(odd, p)
        if transpose:
            outer = outer.T
        # per-row sums stacked: unlike _outer_sums, this form keeps XLA's loop
        # vectorized when the result is reshaped to whole rows in the same fusion
        rows = []
        for i in range(n):
            acc = outer[i, 0] * z[..., 0, :]
            for k in range(1, n):
                acc = acc + outer[i, k] * z[..., k, :]
            rows.append(acc)
        return jnp.stack(rows, axis=-2).reshape(v.shape)
    w = _hadamard_last(v.reshape(*v.shape[:-1], m, p))
    if m > 1:
        w = jnp.matmul(odd.T if transpose else odd, w, precision=_HI)
    return w.reshape(v.shape)


def grouped(dim: int, rotation: RotationOp) -> bool:
    """The Hadamard rotation of rows of ``n = dim/16 <= 8`` groups of 16: the group
    kernels below apply (every byte-aligned width: 16 coordinates fill ``2*bits`` bytes)."""
    return rotation.dense is None and dim % _HADAMARD_FACTOR == 0 and dim // _HADAMARD_FACTOR <= _OUTER_SUM_MAX


@functools.lru_cache(maxsize=None)
def _group_hadamard(bits: int) -> np.ndarray:
    """``H_16`` with its columns in planar order (``packing.plane_order(16, bits)``):
    ``v @ this`` is ``v @ H_16`` with each 16-group's coordinates grouped by plane."""
    h = _rotation.hadamard(_HADAMARD_FACTOR)[:, _packing.plane_order(_HADAMARD_FACTOR, bits)]
    h = np.ascontiguousarray(h, np.float32)
    h.flags.writeable = False
    return h


def _outer_sums(z, outer):
    """``w[..., i, :] = sum_k outer[i, k] * z[..., k, :]`` over the group axis ``-2``.

    Written as broadcasts of one group times one column of ``outer``, so XLA emits one
    vectorized loop over the output instead of one per stacked row sum.
    """
    n = outer.shape[0]
    acc = outer[:, 0, None] * z[..., 0:1, :]
    for k in range(1, n):
        acc = acc + outer[:, k, None] * z[..., k : k + 1, :]
    return acc


def _outer(odd, p: int):
    """The outer Kronecker factor ``odd ⊗ H_(p/16)`` of ``odd ⊗ H_p`` (order ``d/16``).

    For a power-of-two ``d`` the odd part is ``[[1]]`` (``rotation.structured_rotation``)
    and the factor is ``H_(p/16)`` itself: a constant even in programs that take the
    tables as arguments. Built from an ``odd`` argument, XLA would recompute the
    product (and its transpose) for every element of the loop that applies it, and
    the sums' rounding would depend on how the program receives its tables.
    """
    h = jnp.asarray(_rotation.hadamard(p // _HADAMARD_FACTOR), jnp.float32)
    return h if odd.shape == (1, 1) else jnp.kron(odd, h)


def encode_groups(x, tabs: Tables, bits: int):
    """Hadamard encode (``grouped`` rows): packed uint8 ``(..., n, 2*bits)`` — row
    ``j``'s bytes are ``packed[j].reshape(-1)`` — and float32 norms ``(...)``.

    The pipeline of :func:`encode_indices` + ``pack`` with one reordering: the rotation
    is linear, so ``1/(||x|| + eps)`` scales its output rather than its input (the
    same up to float32 rounding: the norms are bit for bit those of :func:`_normalize`,
    and an index can differ by one level only where a rotated coordinate lies within
    rounding of a boundary). That saves a pass over the block, and every loop has a
    shape XLA's CPU backend vectorizes: none ends in a reshape, and the quantizer
    compares against constant boundaries, not inner axes of 8 against a runtime-valued
    table.

    1. the norms from ``x``, as :func:`_normalize` takes them (bit for bit);
    2. the signs, exact in ``x``'s dtype, then one GEMM per 16-group with
       :func:`_group_hadamard`: each group's planes ``(..., n, g, 16/g)``;
    3. the outer factor as sums over groups, times ``1/(||x|| + eps)``, one plane at a
       time, stacked plane-major (a concatenate: XLA materializes it rather than
       recomputing the sums for every compare of the quantizer);
    4. quantize against the codebook's boundaries as constants; pack each group's
       planes into its ``2*bits`` bytes.

    A block holding a vector whose squares overflow float32 is encoded again by the
    rescaled path of :func:`_scales_robust` (``lax.cond``; under ``vmap`` both run).
    Its other vectors come out byte for byte as without it.
    """
    xf = x.astype(jnp.float32)
    sq = squared_norms(xf, True)
    norms = jnp.sqrt(sq)
    # the sign flip is exact in x's own dtype; done before the conversion it keeps the
    # GEMM operand from sharing `xf` with the norms (which XLA would then materialize)
    v = (x * tabs.rotation.signs.astype(x.dtype)).astype(jnp.float32)
    fast = _groups_pass(v, 1.0 / (norms + NORM_EPS), tabs, bits), norms

    def robust(x, sq):
        norms, pre, inv = _scales_robust(x.astype(jnp.float32), sq)
        v = (x * tabs.rotation.signs.astype(x.dtype)).astype(jnp.float32)
        return _groups_pass(v * pre[..., None], inv, tabs, bits), norms

    return jax.lax.cond(jnp.any(jnp.isinf(sq)), robust, lambda x, sq: fast, x, sq)


def _groups_pass(v, inv, tabs: Tables, bits: int):
    d = v.shape[-1]
    n, g = d // _HADAMARD_FACTOR, _packing.plane_count(bits)
    batch = v.shape[:-1]
    cb, grid = quantizer(d, bits)
    z = jnp.matmul(v.reshape(*batch, n, _HADAMARD_FACTOR), _group_hadamard(bits), precision=_HI)
    z = z.reshape(*batch, n, g, _HADAMARD_FACTOR // g)
    outer = _outer(tabs.rotation.odd, d // tabs.rotation.odd.shape[0])
    inv = inv[..., None, None]
    y = jnp.stack([_outer_sums(z[..., p, :], outer) * inv for p in range(g)], axis=-3)  # (..., g, n, 16/g)
    q = quantize(y, cb.boundaries, grid)
    return _packing.pack_planes(jnp.moveaxis(q, -3, -2), bits)


def decode_groups(packed, norms, tabs: Tables, bits: int, dtype, norm_correction=False):
    """Hadamard decode (``grouped`` rows) of packed rows ``(..., d*bits/8)``: vectors
    ``(..., n, 16)`` of ``dtype`` (row ``j`` is ``out[j].reshape(-1)``).

    The arithmetic of :func:`decode_rows`, but the indices come out of
    :func:`packing.unpack_groups` already in natural order (no planes, no transpose),
    and the last loop writes 16-groups rather than whole rows (a reshape at the end of
    a fusion is not vectorized by XLA's CPU backend; the caller's reshape is free).

    Norm correction scales a per-vector copy of the codebook, so the gather applies
    it and the reduction, the GEMM and the outer sums stay in the fused loops.
    Scaling the gathered centroids, or the output, instead would let XLA's CPU backend
    take the reduction, the scaling and the GEMM (or the outer sums) out of those
    loops into one YNNPACK call.
    """
    d = dim_of(tabs.rotation)
    n = d // _HADAMARD_FACTOR
    batch = packed.shape[:-1]
    idx = _packing.unpack_groups(packed, bits, d).astype(jnp.int32)  # (..., d/g, g)
    if norm_correction:
        c = jnp.take(tabs.centroids, idx, mode="clip").reshape(*batch, d)
        table = tabs.centroids * jax.lax.rsqrt(sum_squares(c))[..., None]
        c = jnp.take_along_axis(table, idx.reshape(*batch, d), axis=-1, mode="clip")
    else:
        c = jnp.take(tabs.centroids, idx, mode="clip")
    c = c.reshape(*batch, n, _HADAMARD_FACTOR)
    h = jnp.asarray(_rotation.hadamard(_HADAMARD_FACTOR), jnp.float32)
    z = jnp.matmul(c, h, precision=_HI)
    outer = _outer(tabs.rotation.odd, d // tabs.rotation.odd.shape[0])
    x_hat = _outer_sums(z, outer.T) * tabs.rotation.signs.reshape(n, _HADAMARD_FACTOR)
    return cast(x_hat * norms.astype(jnp.float32)[..., None, None], dtype)


def sum_squares(v):
    """``sum(v * v, axis=-1)`` in one fixed order: zero-padded to a power of two, then
    halved (``s[:h] + s[h:]``) down to one. Element-wise ops only, so a vector gets
    the same bits in any batch shape and on any backend; XLA's CPU reduction (a
    YNNPACK call) orders its sums by the batch size, so 8- and 16-vector blocks
    would differ in the last bit from 4096-vector ones."""
    s = v * v
    d = s.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    if width != d:
        s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, width - d)])
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


def cast(v, dtype):
    """``v.astype(dtype)`` for float32 ``v``; to bfloat16 by integer round-to-nearest-even
    on the bits instead of XLA's own conversion (chosen by timing on XLA's CPU backend:
    benchmarks/results/design_notes.md). It gives the same bits as ``astype`` for
    every float32 XLA's CPU arithmetic yields: NaN becomes the quiet NaN of its sign,
    ±inf and overflow go to ±inf; a subnormal (XLA's CPU flushes them before they get
    here) rounds correctly too."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return v.astype(dtype)
    u = jax.lax.bitcast_convert_type(v, jnp.uint32)
    r = (u + (jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1)))) >> 16
    r = jnp.where(v != v, ((u >> 16) & jnp.uint32(0x8000)) | jnp.uint32(0x7FC0), r)  # NaN: quiet, signed
    return jax.lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)


def rotate(u, rotation: RotationOp):
    """``y = R u`` for each vector along the last axis."""
    if rotation.dense is not None:
        return jnp.matmul(u, rotation.dense.T, precision=_HI)
    return _kron_apply(u * rotation.signs, rotation.odd, transpose=False)


def unrotate(y, rotation: RotationOp):
    """``u = Rᵀ y`` for each vector along the last axis."""
    if rotation.dense is not None:
        return jnp.matmul(y, rotation.dense, precision=_HI)
    return _kron_apply(y, rotation.odd, transpose=True) * rotation.signs


def _scales_robust(xf, sq):
    """Per-vector ``(norm, pre, inv)`` with ``u = (x * pre) * inv``, also for finite
    vectors whose squares overflow float32.

    Such a vector (entries beyond ~1e19) would get an infinite norm and decode as NaN:
    its norm and direction come from a copy scaled by ``pre = 2**-96`` (exact). The
    scale stays a separate factor — folded into ``inv`` it would be subnormal for the
    largest norms and flushed to zero. Every other vector keeps ``pre = 1`` and the
    plain norm, exactly as :func:`_scales_plain` computes it.
    """
    big = jnp.isinf(sq) & jnp.all(jnp.isfinite(xf), axis=-1)
    small = jax.lax.optimization_barrier(xf * np.float32(2.0**-96))
    small_norms = jnp.sqrt(sum_squares(small))
    norms = jnp.where(big, small_norms * np.float32(2.0**96), jnp.sqrt(sq))
    pre = jnp.where(big, np.float32(2.0**-96), np.float32(1.0))
    inv = 1.0 / jnp.where(big, small_norms, norms + NORM_EPS)
    return norms, pre, inv


def _scales_plain(xf, sq):
    norms = jnp.sqrt(sq)
    return norms, jnp.ones_like(norms), 1.0 / (norms + NORM_EPS)


def squared_norms(xf, fixed_order: bool):
    """``sum(xf * xf, axis=-1)``: in :func:`sum_squares`' fixed order for the Hadamard
    rotation (the same bits in any block), by XLA's reduction for Haar, whose encode
    kernel's GEMM operand shares ``xf`` with it (chosen by timing that kernel:
    benchmarks/results/design_notes.md). Haar's float32 norms can therefore differ in
    the last bit between a block of 8 or 16 vectors and a full one; float16 norms hide
    that.
    """
    return sum_squares(xf) if fixed_order else jnp.sum(xf * xf, axis=-1)


def _normalize(x, fixed_order: bool):
    """``(x / (||x|| + eps), ||x||)`` in float32, as the reference computes them
    (the sum of squares as :func:`squared_norms` orders it).

    The robust per-vector scales above are computed only when some squared norm
    overflowed (``lax.cond`` on a scalar; under ``vmap`` both branches run and a
    select picks, which is still correct). The cond returns per-vector factors only,
    so the scaling itself fuses with whatever consumes ``u``.
    """
    xf = x.astype(jnp.float32)
    sq = squared_norms(xf, fixed_order)
    norms, pre, inv = jax.lax.cond(jnp.any(jnp.isinf(sq)), _scales_robust, _scales_plain, xf, sq)
    return (xf * pre[..., None]) * inv[..., None], norms


def _norms_and_rotate(x, rotation: RotationOp):
    u, norms = _normalize(x, rotation.dense is None)
    return rotate(u, rotation), norms


def encode_indices(x, rotation, boundaries, grid):
    """Unpacked uint8 indices ``(..., d)`` (natural order) and float32 norms ``(...)``."""
    y, norms = _norms_and_rotate(x, rotation)
    return quantize(y, boundaries, grid), norms


def decode_indices(indices, norms, rotation: RotationOp, centroids, dtype, qjl=None, norm_correction=False):
    """Reconstruct ``(..., d)`` vectors of ``dtype`` from uint8 indices and norms.

    ``qjl`` is ``(sketch int8 (..., m), residual_norms (...), matrix (m, d))`` for
    blobs written with the QJL residual (TQ01 read compatibility only).
    ``norm_correction`` (static) rescales the centroid vector to unit length first.
    """
    y_hat = jnp.take(centroids, indices.astype(jnp.int32), mode="clip")
    if qjl is not None:
        sketch, residual_norms, matrix = qjl
        m = matrix.shape[0]
        corr = jnp.matmul(sketch.astype(jnp.float32), matrix, precision=_HI)
        scale = residual_norms.astype(jnp.float32) * np.float32(math.sqrt(math.pi / (2 * m)))
        y_hat = y_hat + corr * scale[..., None]
    return _unit_levels_to_vectors(y_hat, norms, rotation, dtype, norm_correction)


def _unit_levels_to_vectors(y_hat, norms, rotation: RotationOp, dtype, norm_correction: bool):
    """The decode's tail: (norm correction), inverse rotation, scale by the norms, cast."""
    if norm_correction:
        y_hat = y_hat * jax.lax.rsqrt(sum_squares(y_hat))[..., None]
    x_hat = unrotate(y_hat, rotation)
    return cast(x_hat * norms.astype(jnp.float32)[..., None], dtype)


def encode_trellis(x, tabs: Tables, bits: int):
    """Trellis codes uint8 ``(..., d)`` (natural order) and float32 norms ``(...)`` of ``x``:
    the rotated unit vectors searched by :func:`tq_jax._src.trellis.quantize`."""
    y, norms = _norms_and_rotate(x, tabs.rotation)
    return _trellis.quantize(y, bits), norms


def decode_trellis(codes, norms, tabs: Tables, bits: int, dtype, norm_correction=False):
    """Inverse of :func:`encode_trellis`: ``(..., d)`` vectors of ``dtype``."""
    y_hat = _trellis.lookup(codes, bits)
    return _unit_levels_to_vectors(y_hat, norms, tabs.rotation, dtype, norm_correction)


def encode_rows(x, tabs: Tables, bits: int):
    """Packed rows uint8 ``(..., ceil(d*bits/8))`` and float32 norms ``(...)`` of ``x``.

    With byte-aligned rows the indices never exist in natural order: the rotation
    emits them as planes (``packing.plane_order``) that pack with no interleaving.
    """
    d = x.shape[-1]
    if tabs.trellis is not None:
        codes, norms = encode_trellis(x, tabs, bits)
        return _packing.pack(codes, bits), norms
    if grouped(d, tabs.rotation):
        packed, norms = encode_groups(x, tabs, bits)
        return packed.reshape(*x.shape[:-1], d * bits // 8), norms
    if not planar(d, bits):
        idx, norms = encode_indices(x, tabs.rotation, tabs.boundaries, tabs.grid)
        return _packing.pack(idx, bits), norms
    g = _packing.plane_count(bits)
    u, norms = _normalize(x, tabs.rotation.dense is None)
    if tabs.planar_dense is not None:
        y = jnp.matmul(u, tabs.planar_dense.T, precision=_HI).reshape(*u.shape[:-1], g, d // g)
    else:
        y = jnp.swapaxes(rotate(u, tabs.rotation).reshape(*u.shape[:-1], d // g, g), -1, -2)
    return _packing.pack_planes(quantize(y, tabs.boundaries, tabs.grid), bits), norms


def decode_rows(packed, norms, tabs: Tables, bits: int, dtype, norm_correction=False):
    """Inverse of :func:`encode_rows`: ``(..., d)`` vectors of ``dtype``.

    Byte-aligned rows unpack as words straight into natural order
    (:func:`packing.unpack_groups`), so the rotation applies as is: no planes to
    interleave, no row-permuted copy of the matrix.
    """
    d = dim_of(tabs.rotation)
    if tabs.trellis is not None:
        return decode_trellis(_packing.unpack(packed, bits, d), norms, tabs, bits, dtype, norm_correction)
    if not planar(d, bits):
        idx = _packing.unpack(packed, bits, d)
        return decode_indices(idx, norms, tabs.rotation, tabs.centroids, dtype, norm_correction=norm_correction)
    idx = _packing.unpack_groups(packed, bits, d).astype(jnp.int32)
    c = jnp.take(tabs.centroids, idx, mode="clip").reshape(*packed.shape[:-1], d)
    return _unit_levels_to_vectors(c, norms, tabs.rotation, dtype, norm_correction)


@functools.partial(jax.jit, static_argnames="bits")
def encode_jit(x, tabs, *, bits):
    return encode_rows(x, tabs, bits)


@functools.partial(jax.jit, static_argnames=("bits", "dtype", "norm_correction"))
def decode_jit(packed, norms, tabs, *, bits, dtype, norm_correction):
    return decode_rows(packed, norms, tabs, bits, dtype, norm_correction)


def dim_of(rotation: RotationOp) -> int:
    return (rotation.dense if rotation.dense is not None else rotation.signs).shape[0]


# --------------------------------------------------------------------------- index streams
#
# A block of B vectors as the TQ01 index section holds it: one LSB-first bit stream of
# B * d * bits bits (rows are not byte-padded when d * bits % 8 != 0).


def layout(dim: int, bits: int, rotation: str, trellis: bool = False) -> str:
    """Which kernel family a ``(dim, bits, rotation)`` codec runs: ``"trellis"`` (trellis
    codes, natural order: one bit stream over the block), ``"groups"`` (the Hadamard
    group kernels), ``"planar"`` (byte-aligned rows, index planes) or ``"natural"`` (rows
    that are not byte-aligned: one bit stream over the block)."""
    if trellis:
        return "trellis"
    if rotation != "haar" and dim % _HADAMARD_FACTOR == 0 and dim // _HADAMARD_FACTOR <= _OUTER_SUM_MAX:
        return "groups"
    return "planar" if planar(dim, bits) else "natural"


def encode_stream(x, tabs: Tables, bits: int):
    """``(stream, norms)`` of a block ``x`` (B, d): ``stream`` is a uint8 array whose
    C-order flattening starts with the block's index stream (``ceil(B*d*bits/8)``
    bytes); ``norms`` float32 (B,).

    The group kernel's stream comes out as ``(B, d/16, 2*bits)``: callers flatten it
    on the host for free, so XLA's last loop writes the packed groups as they are
    instead of ending in a reshape (a bitcast), which XLA's CPU backend does not
    vectorize (the rule :func:`decode_groups` follows too).
    """
    dim = x.shape[-1]
    if tabs.trellis is not None:
        codes, norms = encode_trellis(x, tabs, bits)
        return _packing.pack(codes.reshape(-1), bits), norms
    if grouped(dim, tabs.rotation):
        return encode_groups(x, tabs, bits)
    if planar(dim, bits):  # byte-aligned rows: the stream is the rows
        packed, norms = encode_rows(x, tabs, bits)
        return packed.reshape(-1), norms
    idx, norms = encode_indices(x, tabs.rotation, tabs.boundaries, tabs.grid)
    return _packing.pack(idx.reshape(-1), bits), norms


def decode_stream(stream, norms, tabs: Tables, bits: int, dtype, norm_correction=False):
    """Inverse of :func:`encode_stream`: the ``B = norms.shape[0]`` vectors of a block
    whose index stream is ``stream`` (uint8, exactly ``B*d*bits/8`` bytes, B a multiple
    of 8), as an array of ``dtype`` whose C-order flattening is ``(B, d)``."""
    n_vec, dim = norms.shape[0], dim_of(tabs.rotation)
    if tabs.trellis is not None:
        codes = _packing.unpack(stream, bits, n_vec * dim).reshape(n_vec, dim)
        return decode_trellis(codes, norms, tabs, bits, dtype, norm_correction)
    if grouped(dim, tabs.rotation):  # (B, d/16, 16) out: the caller's reshape is free
        rows = stream.reshape(n_vec, dim * bits // 8)
        return decode_groups(rows, norms, tabs, bits, dtype, norm_correction)
    if planar(dim, bits):  # byte-aligned rows
        rows = stream.reshape(n_vec, dim * bits // 8)
        return decode_rows(rows, norms, tabs, bits, dtype, norm_correction)
    idx = _packing.unpack(stream, bits, n_vec * dim).reshape(n_vec, dim)
    return decode_indices(idx, norms, tabs.rotation, tabs.centroids, dtype, norm_correction=norm_correction)


def decode_stream_qjl(stream, norms, sketch, residual_norms, rotation, centroids, qjl_matrix, bits: int, dtype):
    """:func:`decode_stream` for blobs written with the QJL residual (TQ01 v1 read only)."""
    n_vec, dim = norms.shape[0], dim_of(rotation)
    idx = _packing.unpack(stream, bits, n_vec * dim).reshape(n_vec, dim)
    return decode_indices(idx, norms, rotation, centroids, dtype, (sketch, residual_norms, qjl_matrix))


decode_stream_jit = jax.jit(decode_stream, static_argnames=("bits", "dtype", "norm_correction"))
decode_stream_qjl_jit = jax.jit(decode_stream_qjl, static_argnames=("bits", "dtype"))
