"""Bit-packing of codebook indices: an LSB-first bit stream, uint8/uint32 ops only.

Index ``i`` of a row occupies bits ``[i*bits, (i+1)*bits)`` of a little-endian bit
stream; a row of ``n`` indices packs to ``ceil(n*bits/8)`` bytes and the unused high
bits of the last byte are zero. This is the layout of ``tqai.packing`` (the TQ01
reference), for every width it supports (2, 3, 4, 6, 8), extended to 1..8.

Eight indices of ``bits`` bits always fill exactly ``bits`` bytes, so both directions
work on groups of 8: pad the row to whole groups, view it as ``(..., groups, 8)``,
and build each of the ``bits`` output bytes by OR-ing the shifted pieces of the (at
most two) indices that overlap it. The loops below run over those static positions
at trace time; XLA sees a handful of fused element-wise ops, never a loop over
elements, and never a uint64 (results do not depend on ``jax_enable_x64``).

Golden vectors (from the reference, also in tests/test_packing.py)::

    bits=2  [1, 2, 3, 0, 3]              -> [57, 3]
    bits=3  [1, 2, 3, 4, 5, 6, 7, 0, 5]  -> [209, 88, 31, 5]
    bits=4  [1, 2, 3]                    -> [33, 3]
    bits=6  [1, 63, 5, 33, 7]            -> [193, 95, 132, 7]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from typing import TYPE_CHECKING

from jax import lax
import numpy as np

if TYPE_CHECKING:  # annotations only; jaxtyping is not a runtime dependency
    from jaxtyping import Array, UInt8, UInt32

__all__ = ["pack", "unpack", "pack_planes", "unpack_groups", "plane_count", "plane_order", "packed_nbytes", "BITS_RANGE"]

BITS_RANGE = range(1, 9)
_GROUP = 8  # indices per group; a group packs into exactly `bits` bytes


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in BITS_RANGE:
        raise ValueError(
            f"`bits` must be an int in 1..8, got {bits!r}: bits sets the codebook "
            f"size 2**bits and the packed width of each index."
        )


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` indices of ``bits`` bits pack into: ``ceil(n*bits/8)``."""
    _check_bits(bits)
    n = int(n)
    if n < 0:
        raise ValueError(f"index count must be >= 0, got {n}")
    return (n * bits + 7) // 8


def _overlaps(bits: int, group: int = _GROUP):
    """Static (index position, byte position, shift) triples of one group.

    ``group`` indices of ``bits`` bits fill ``group*bits/8`` whole bytes.
    ``shift = i*bits - 8*j``: a positive shift moves index ``i`` left into byte
    ``j``; a negative one moves byte ``j``'s bits right onto index ``i``.
    """
    out = []
    for i in range(group):
        for j in range(group * bits // 8):
            lo, hi = i * bits, (i + 1) * bits
            if lo < 8 * (j + 1) and hi > 8 * j:
                out.append((i, j, lo - 8 * j))
    return tuple(out)


def _shift(v, s: int):
    """``v << s`` for s >= 0, logical ``v >> -s`` otherwise (uint32 operands)."""
    if s >= 0:
        return lax.shift_left(v, jnp.uint32(s))
    return lax.shift_right_logical(v, jnp.uint32(-s))


@functools.partial(jax.jit, static_argnames="bits")
def pack(indices: UInt8[Array, "*batch n"], bits: int) -> UInt8[Array, "*batch nbytes"]:
    """Pack the last axis of ``indices`` into an LSB-first bit stream.

    Args:
        indices: uint8 array ``(..., n)``; each value must be below ``2**bits``
            (higher bits are masked off).
        bits: width of one index, 1..8 (static).

    Returns:
        uint8 array ``(..., ceil(n*bits/8))``.

    Examples:
        >>> import numpy as np
        >>> np.asarray(pack(np.array([1, 2, 3], np.uint8), bits=4)).tolist()
        [33, 3]
    """
    _check_bits(bits)
    indices = jnp.asarray(indices)
    if indices.ndim == 0:
        raise ValueError("pack needs at least a 1-D array of indices")
    *batch, n = indices.shape
    nbytes = (n * bits + 7) // 8
    if bits == 8:
        return indices.astype(jnp.uint8)
    groups = -(-n // _GROUP)
    pad = groups * _GROUP - n
    v = indices.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    if pad:
        v = jnp.pad(v, [(0, 0)] * len(batch) + [(0, pad)])
    v = v.reshape(*batch, groups, _GROUP)
    out = [None] * bits
    for i, j, s in _overlaps(bits):
        piece = _shift(v[..., i], s) & jnp.uint32(0xFF)
        out[j] = piece if out[j] is None else out[j] | piece
    packed = jnp.stack(out, axis=-1).astype(jnp.uint8).reshape(*batch, groups * bits)
    return packed[..., :nbytes]


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def unpack(packed: UInt8[Array, "*batch nbytes"], bits: int, n: int) -> UInt8[Array, "*batch n"]:
    """Inverse of :func:`pack`: recover ``n`` indices from the last axis.

    Args:
        packed: uint8 array ``(..., nbytes)`` with ``nbytes >= ceil(n*bits/8)``
            (extra trailing bytes are ignored).
        bits: width of one index, 1..8 (static).
        n: number of indices per row (static).

    Returns:
        uint8 array ``(..., n)`` with values below ``2**bits``.

    Raises:
        ValueError: if the rows hold fewer than ``ceil(n*bits/8)`` bytes.
    """
    _check_bits(bits)
    packed = jnp.asarray(packed)
    *batch, have = packed.shape
    need = (n * bits + 7) // 8
    if have < need:
        raise ValueError(
            f"unpack: {n} indices of {bits} bits need {need} bytes per row, got {have}"
        )
    if bits == 8:
        return packed[..., :n].astype(jnp.uint8)
    groups = -(-n // _GROUP)
    v = packed[..., :need].astype(jnp.uint32)
    pad = groups * bits - need
    if pad:
        v = jnp.pad(v, [(0, 0)] * len(batch) + [(0, pad)])
    v = v.reshape(*batch, groups, bits)
    out = [None] * _GROUP
    for i, j, s in _overlaps(bits):
        piece = _shift(v[..., j], -s)
        out[i] = piece if out[i] is None else out[i] | piece
    mask = jnp.uint32((1 << bits) - 1)
    idx = (jnp.stack(out, axis=-1) & mask).astype(jnp.uint8).reshape(*batch, groups * _GROUP)
    return idx[..., :n]


# --------------------------------------------------------------------------- planes
#
# The codec kernels do not need indices in their natural order, only the right bytes.
# A row of ``n`` indices splits into groups of ``G = plane_count(bits)`` consecutive
# indices — the fewest that fill whole bytes (G = 2 at 4 bits: one byte) — and
# *plane* ``i`` collects index ``i`` of every group: ``planes[..., i, g]`` is the
# natural index ``g*G + i``. Each packed byte is then an OR of shifted planes (no
# interleaving of indices). The encoder's rotation rows are permuted once to produce
# coordinates in that order, so the permutation costs nothing per vector. The decoder
# reads byte-aligned rows back in natural order, grouped (:func:`unpack_groups`).
# Both need ``n % G == 0``, i.e. byte-aligned rows.


def plane_count(bits: int) -> int:
    """Indices per byte-aligned group: ``8 // gcd(8, bits)`` (1, 2, 4 or 8)."""
    _check_bits(bits)
    return 8 // math.gcd(8, bits)


def plane_order(n: int, bits: int):
    """Natural positions in planar order: ``indices[..., plane_order(n, bits)]`` are
    the planes of ``indices`` laid end to end."""
    g = plane_count(bits)
    if n % g:
        raise ValueError(f"planes need a row length that is a multiple of {g} at {bits} bits, got {n}")
    return np.arange(n).reshape(n // g, g).T.reshape(-1)


def _check_planes(shape, bits):
    g = plane_count(bits)
    if len(shape) < 2 or shape[-2] != g:
        raise ValueError(f"planes at {bits} bits must have shape (..., {g}, m), got {tuple(shape)}")
    return g


@functools.partial(jax.jit, static_argnames="bits")
def pack_planes(planes: UInt8[Array, "*batch G m"], bits: int) -> UInt8[Array, "*batch nbytes"]:
    """Pack planar indices (see :func:`plane_order`) into the bytes :func:`pack` makes
    of the same indices in natural order.

    Args:
        planes: uint8 ``(..., G, m)`` with ``G = plane_count(bits)``; values must be
            below ``2**bits`` (not masked: the quantizer never exceeds it).
        bits: width of one index, 1..8 (static).

    Returns:
        uint8 ``(..., m*G*bits/8)``, equal to ``pack(natural, bits)``.
    """
    _check_bits(bits)
    planes = jnp.asarray(planes, jnp.uint8)
    g = _check_planes(planes.shape, bits)
    per_group = g * bits // 8
    out = [None] * per_group
    for i, j, s in _overlaps(bits, g):
        v = planes[..., i, :]
        piece = lax.shift_left(v, jnp.uint8(s)) if s >= 0 else lax.shift_right_logical(v, jnp.uint8(-s))
        out[j] = piece if out[j] is None else out[j] | piece
    if per_group == 1:
        return out[0]
    m = planes.shape[-1]
    return jnp.stack(out, axis=-1).reshape(*planes.shape[:-2], m * per_group)


def _check_rows(fn: str, shape, bits: int, n: int) -> int:
    """``plane_count(bits)`` once ``shape`` is checked to hold byte-aligned rows of ``n``."""
    g = plane_count(bits)
    if n % g or shape[-1] != n * bits // 8:
        raise ValueError(
            f"{fn}: rows of {n} indices of {bits} bits need n % {g} == 0 and "
            f"{n * bits // 8 if n % g == 0 else 'whole'} bytes, got {shape[-1]}"
        )
    return g


@functools.partial(jax.jit, static_argnames=("bits", "n"))
def unpack_groups(packed: UInt8[Array, "*batch nbytes"], bits: int, n: int) -> UInt32[Array, "*batch m G"]:
    """:func:`unpack` of byte-aligned rows, shaped ``(..., n/G, G)`` with
    ``G = plane_count(bits)``: ``out[..., k, i]`` is index ``k*G + i`` (natural order).

    Each group's ``G*bits/8`` bytes (1 to 7) are read as one or two little-endian
    uint32 words. Within one word (1, 2, 3, 4, 6 and 8 bits) lane ``i`` shifts its
    index out by a constant vector across the lanes; across two words (5 and 7 bits)
    each lane is its own element-wise loop with scalar shifts from only the words it
    overlaps, which XLA's CPU backend fuses with the codebook lookup (the timing
    behind the split: benchmarks/results/design_notes.md). The output is in natural
    order, so it needs no transpose back from planes.

    Args:
        packed: uint8 ``(..., n*bits/8)`` byte-aligned rows.
        bits: width of one index, 1..8 (static).
        n: indices per row (static), a multiple of ``plane_count(bits)``.

    Returns:
        uint32 ``(..., n/G, G)`` with values below ``2**bits``.
    """
    packed = jnp.asarray(packed, jnp.uint8)
    g = _check_rows("unpack_groups", packed.shape, bits, n)
    per_group = g * bits // 8
    v = packed.reshape(*packed.shape[:-1], n // g, per_group).astype(jnp.uint32)
    words = []
    for k in range(-(-per_group // 4)):
        word = v[..., 4 * k]
        for j in range(4 * k + 1, min(4 * k + 4, per_group)):
            word = word | (v[..., j] << jnp.uint32(8 * (j - 4 * k)))
        words.append(word)
    if len(words) > 1:
        return jnp.stack([_lane(words, i * bits, bits) for i in range(g)], axis=-1)
    starts = np.arange(g) * bits  # lane i's first bit in the group (< 32)
    piece = words[0][..., None] >> jnp.asarray(starts.astype(np.uint32))  # unsigned: logical
    return piece & jnp.uint32((1 << bits) - 1)


def _lane(words, start: int, bits: int):
    """The ``bits``-bit index starting at bit ``start`` of the little-endian ``words``."""
    k, r = divmod(start, 32)
    x = words[k] >> jnp.uint32(r) if r else words[k]
    if r + bits > 32:
        x = x | (words[k + 1] << jnp.uint32(32 - r))
    return x & jnp.uint32((1 << bits) - 1)

